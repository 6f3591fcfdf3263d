"""Tokenizer rebuild: the backend that transformers 5's rebuilding classes start from (checked with
5.24), and the ids it gives tokenizer.json's added tokens.

The rebuilding classes are the ones in ``runtime.tokenizer_pipeline.REBUILT_PIPELINES``
(``LlamaTokenizer``, ``Qwen2Tokenizer``, ...). Such a class never loads tokenizer.json whole
(``TokenizersBackend.convert_to_native_format``). It takes the model's ``vocab`` and ``merges`` and
the post-processor, and builds ``BPE(vocab, merges)`` afresh, with no added tokens. Then it adds
back only two kinds of token (``runtime.tokenizer_class.tokens_to_add``):

- the declared added tokens: tokenizer_config.json's ``added_tokens_decoder``, or tokenizer.json's
  own when the config has none;
- the named special tokens.

So an added token that tokenizer.json lists and the config does not declare is gone, and its
text is plain text. A token the vocabulary lacks gets the next free id, in the order the tokens
are added, not tokenizer.json's id. If one is left out, the tokens after it move down by one, and
a named special token that was left out comes back last. (A gap in tokenizer.json's added-token
ids is another matter: the ``tokenizers`` library closes it when it loads the file, in every
loader, lorafleet's generic path included. So the ids that the rebuild is compared with are the
ones the file loads with.)

``fresh_backend`` builds that same backend: it shares the loaded model, so it costs nothing more
than the load. lorafleet then adds the same tokens in the same order, which reproduces the drop.
``moved_id`` finds where the result gives a token another id than the loaded file does, or gives
the file's id for one token to another token. Such a checkpoint is refused at load. The model
learnt the file's ids, so every prompt holding such a token, and every such token the model
generates, would be read as another token, as transformers 5 reads it. A clear error beats text
that is silently wrong. Declaring every added token of tokenizer.json in ``added_tokens_decoder``,
with its id, fixes the checkpoint.
"""
from __future__ import annotations

from typing import Any


def fresh_backend(file_tokenizer: Any) -> Any:
    """A ``tokenizers.Tokenizer`` over ``file_tokenizer``'s model (its vocabulary and merges, shared,
    not copied) with its post-processor and nothing else: no added tokens, normaliser,
    pre-tokenizer, decoder, padding or truncation. This is what a rebuilding class starts from."""
    from tokenizers import Tokenizer

    tok = Tokenizer(file_tokenizer.model)
    tok.post_processor = file_tokenizer.post_processor
    return tok


def moved_id(file_tokenizer: Any, rebuilt: Any) -> str | None:
    """How ``rebuilt`` (a ``fresh_backend`` with its tokens added) gives a token another id than
    ``file_tokenizer`` (tokenizer.json as loaded) does, or gives the file's id for one token to
    another; None when every added token keeps the file's id. Tokens the rebuild left out are
    not counted: as in transformers, their text is plain text, and their ids decode to nothing."""
    file_added = {i: token.content for i, token in file_tokenizer.get_added_tokens_decoder().items()}
    file_ids = {content: i for i, content in file_added.items()}
    vocab = file_tokenizer.model  # the vocabulary's pieces, whatever the added tokens' normalisation
    for new_id, token in sorted(rebuilt.get_added_tokens_decoder().items()):
        file_id = file_ids.get(token.content, vocab.token_to_id(token.content))
        if file_id is not None and file_id != new_id:
            return f"{token.content!r} gets id {new_id}, where tokenizer.json has it at id {file_id}"
        holder = file_added.get(new_id, vocab.id_to_token(new_id))
        if holder is not None and holder != token.content:
            return f"{token.content!r} gets id {new_id}, which tokenizer.json gives to {holder!r}"
    return None


def left_out(file_tokenizer: Any, rebuilt: Any) -> list[str]:
    """tokenizer.json's added tokens that are not added tokens of ``rebuilt`` (neither declared nor named)."""
    held = {token.content for token in rebuilt.get_added_tokens_decoder().values()}
    return [token.content for _, token in sorted(file_tokenizer.get_added_tokens_decoder().items()) if token.content not in held]
