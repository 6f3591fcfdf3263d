"""The added tokens of the classes that rebuild their backend (runtime.tokenizer_rebuild), against
transformers' ``AutoTokenizer``. The folders are shaped like real checkpoints: Llama-2-style files
whose ``<unk>`` / ``<s>`` / ``</s>`` are vocabulary pieces, and byte-level files whose special tokens
are only added tokens, as Qwen2's are. On top of those, tokenizer.json lists added tokens that
tokenizer_config.json's ``added_tokens_decoder`` leaves out. transformers drops them. Before,
lorafleet kept them: ``<tool>`` was one token here and plain text there. Where the drop moves
another token's id, lorafleet refuses the checkpoint instead."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.tokenizer import Tokenizer, TokenizerError
from tests.test_tokenizer_pipeline import BYTE_LEVEL, LLAMA, write_byte_level, write_configs, write_sentencepiece

NO_INFILL = dict.fromkeys(["prefix_token", "middle_token", "suffix_token", "eot_token", "fill_token"])
# class -> (tokenizer.json shape, tokenizer_config.json, config.json's model_type), as the pipeline tests build them.
CLASSES = {
    "LlamaTokenizer": ("sentencepiece", LLAMA, "llama"),
    "CodeLlamaTokenizer": ("sentencepiece", {**LLAMA, "tokenizer_class": "CodeLlamaTokenizer", **NO_INFILL}, "llama"),
    "GemmaTokenizer": ("sentencepiece", {**LLAMA, "tokenizer_class": "GemmaTokenizerFast", "pad_token": "<unk>", "mask_token": "<unk>"}, "llama"),
    "Qwen2Tokenizer": ("byte_level", BYTE_LEVEL, "qwen2"),
    "Qwen3_5Tokenizer": ("byte_level", {**BYTE_LEVEL, "tokenizer_class": "Qwen3_5Tokenizer"}, "llama"),
    "GPT2Tokenizer": ("byte_level", {**BYTE_LEVEL, "tokenizer_class": "GPT2Tokenizer"}, "llama"),
    "GPTNeoXTokenizer": ("byte_level", {**BYTE_LEVEL, "tokenizer_class": "GPTNeoXTokenizerFast"}, "llama"),
    "CohereTokenizer": ("byte_level", {**BYTE_LEVEL, "tokenizer_class": "CohereTokenizerFast", "cls_token": "<s>", "sep_token": "</s>",
                                       "mask_token": "</s>"}, "llama"),
}
TEXTS = ["hi<tool>", "<a>hello<b> world", "<s>hi</s>", "<|im_start|>user\nhi<|im_end|>", "x <pad> y"]


def write_checkpoint(folder: Path, tokenizer_class: str, extra: list[str], undeclared: set[str]) -> None:
    """A checkpoint for ``tokenizer_class`` whose tokenizer.json lists ``extra`` as added tokens after its
    own (none of them in the vocabulary; a byte-level file's special tokens are only added tokens
    too, as in Qwen2's), and whose tokenizer_config.json declares all of them but ``undeclared``."""
    shape, tokenizer_config, model_type = CLASSES[tokenizer_class]
    if shape == "sentencepiece":
        write_sentencepiece(folder, legacy_file=True)
    else:
        write_byte_level(folder, "gpt2")
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    if shape == "byte_level":  # its special tokens are the vocabulary's last ids: the others stay 0..n-1
        for token in data["added_tokens"]:
            del vocab[token["content"]]
    data["added_tokens"] += [{"content": text, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": False}
                             for text in extra]
    next_id = len(vocab)
    for token in data["added_tokens"]:
        token["id"] = vocab.get(token["content"], next_id)
        next_id += token["content"] not in vocab
    added = data["added_tokens"]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    declared = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added if t["content"] not in undeclared}
    write_configs(folder, {**tokenizer_config, "added_tokens_decoder": declared}, model_type)


def added_tokens(tokens: dict) -> dict[int, str]:
    return {i: repr(t) for i, t in tokens.items()}


def file_ids(folder: Path) -> dict[str, int]:
    return {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}


@pytest.mark.parametrize("tokenizer_class", list(CLASSES))
@pytest.mark.parametrize("undeclared", [{"<tool>"}, {"</s>", "<pad>", "<tool>"}])
def test_added_tokens_the_config_leaves_out_are_dropped_as_in_transformers(tmp_path, tokenizer_class, undeclared):
    """``<tool>``, the last added token, is left out of added_tokens_decoder: transformers drops it (its
    text is plain text, its id decodes to nothing). Where the eos ``</s>`` and the tokens after it are
    left out, the eos comes back as a named special token with its own flags, and (where the
    vocabulary lacks it) the next free id, which is its own id again."""
    from transformers import AutoTokenizer

    write_checkpoint(tmp_path, tokenizer_class, ["<pad>", "<tool>"], undeclared)
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ref).__name__ == ours.tokenizer_class == tokenizer_class
    assert added_tokens(ours._tok.get_added_tokens_decoder()) == added_tokens(ref.added_tokens_decoder)
    assert ours.vocab_size == len(ref) and (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)
    tool_id = file_ids(tmp_path)["<tool>"]  # tokenizer.json's last id, which nothing holds now
    assert ours.token_to_id("<tool>") is None and ours.decode([tool_id], skip_special_tokens=False) == ref.decode([tool_id]) == ""


@pytest.mark.parametrize("tokenizer_class", list(CLASSES))
def test_a_left_out_added_token_that_moves_another_id_is_refused(tmp_path, tokenizer_class):
    """``<a>`` is left out, so transformers gives ``<b>`` the id tokenizer.json gives ``<a>``: the model
    would read ``<b>`` as ``<a>``. lorafleet refuses the checkpoint, naming both."""
    from transformers import AutoTokenizer

    write_checkpoint(tmp_path, tokenizer_class, ["<a>", "<b>"], {"<a>"})
    file_id = file_ids(tmp_path)
    assert AutoTokenizer.from_pretrained(str(tmp_path)).convert_tokens_to_ids("<b>") == file_id["<a>"]
    with pytest.raises(TokenizerError, match=rf"transformers' {tokenizer_class} rebuilds the tokenizer .*leaves out \['<a>'\].* '<b>' gets id "
                                             rf"{file_id['<a>']}, where tokenizer.json has it at id {file_id['<b>']}: .*declare every added token"):
        Tokenizer(tmp_path)


def test_a_left_out_named_special_token_that_comes_back_last_is_refused(tmp_path):
    """The eos ``</s>``, an added token only (as Qwen2's ``<|im_end|>`` is), left out of added_tokens_decoder:
    transformers gives ``<a>`` its id, and adds it back after the declared ones, with another id."""
    from transformers import AutoTokenizer

    write_checkpoint(tmp_path, "Qwen2Tokenizer", ["<a>"], {"</s>"})
    file_id = file_ids(tmp_path)
    assert AutoTokenizer.from_pretrained(str(tmp_path)).eos_token_id != file_id["</s>"]
    with pytest.raises(TokenizerError, match="'<a>' gets id"):
        Tokenizer(tmp_path)


def test_the_generic_class_keeps_every_added_token_of_tokenizer_json_as_transformers_does(tmp_path):
    """TokenizersBackend loads tokenizer.json whole: nothing is dropped, and nothing is refused."""
    from transformers import AutoTokenizer

    write_checkpoint(tmp_path, "GPT2Tokenizer", ["<a>", "<b>"], {"<a>"})
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert added_tokens(ours._tok.get_added_tokens_decoder()) == added_tokens(ref.added_tokens_decoder)
    assert ours.encode("<a>hello<b>") == ref("<a>hello<b>")["input_ids"] and ours.token_to_id("<a>") is not None
