"""Tokenizer class: the transformers class ``AutoTokenizer`` loads a checkpoint's tokenizer as, and
what that class makes of the special tokens around an encoded text (checked with transformers 5.24).

With a ``tokenizer.json`` in the checkpoint (which lorafleet requires), transformers drops
tokenizer_config.json's ``add_bos_token`` and ``add_eos_token`` before it builds the tokenizer,
whatever its class (``PreTrainedTokenizerBase._from_pretrained``): tokenizer.json's post-processor
alone says which special tokens ``encode`` adds, and a tokenizer.json without one adds none
(``TokenizersBackend.update_post_processor``, both flags off). So ``[256, 71, 72]`` for a
tokenizer.json whose post-processor puts bos first, with or without ``add_eos_token: true``;
``LlamaTokenizer``, ``Qwen2Tokenizer``, ``GemmaTokenizer``, ``GPT2Tokenizer`` and the generic
``TokenizersBackend`` (``PreTrainedTokenizerFast``) all keep the post-processor so.

``REBUILT_POST_PROCESSORS``: the classes (for decoder-only checkpoints) whose ``__init__`` puts a
post-processor of their own in its place, from their defaults, the config's flags being gone:
``CodeLlamaTokenizer`` always puts bos first and never appends eos, ``GPTNeoXTokenizer`` adds
nothing. The bos is the tokenizer's named one.

``CLASS_SPECIAL_TOKENS``: the named special tokens (bos, eos, unk, pad, ...) a class defaults to
when neither tokenizer_config.json nor special_tokens_map.json has the key (``"bos_token": null``
names none): ``LlamaTokenizer`` and ``CodeLlamaTokenizer`` ``<s>`` / ``</s>`` / ``<unk>``,
``GPTNeoXTokenizer`` ``<|endoftext|>``, ... (``TokenizersBackend`` has none). They are the
tokenizer's as if named: CodeLlamaTokenizer's bos first, the eos among the stop tokens, the chat
template's variables. As in transformers (``TokenizersBackend.__init__``), each named special token
that tokenizer.json does not list among its added tokens becomes a special added token (a new id
when the vocabulary lacks it), except that a bos or eos the vocabulary lacks is refused
(``TokenizerError``), as every prompt or stop would then hold an id the model does not have.
These classes, and others, also build their own normaliser, pre-tokenizer and decoder:
``runtime.tokenizer_pipeline``.

``auto_tokenizer_class(tokenizer_config, model_config, byte_level)``: the class, as ``AutoTokenizer`` picks it for
the model types lorafleet serves: ``qwen2`` always loads ``Qwen2Tokenizer`` and ``mistral``
``TokenizersBackend`` (without mistral-common), whatever class the configs name; otherwise
(``llama``, or no ``model_type``) tokenizer_config.json's ``tokenizer_class``, else
config.json's, with ``Fast`` taken off, as transformers looks it up; none named (or
``PreTrainedTokenizerFast``) is ``TokenizersBackend``, and so is ``LlamaTokenizer`` over a tokenizer.json whose text names
``"ByteLevel"`` (transformers' ``_tokenizer_json_has_byte_level``: Llama-3-style checkpoints that
name LlamaTokenizer). Any other name is returned as named: where transformers loads
``TokenizersBackend`` instead (a name it does not know) the tokens are the same, since such a name
is neither in ``REBUILT_POST_PROCESSORS`` nor in ``runtime.tokenizer_pipeline``'s
``REBUILT_PIPELINES``: it keeps tokenizer.json's steps and post-processor. Not reproduced:
transformers' encoder and seq2seq classes (``BertTokenizer``, ``T5Tokenizer``, ...), which add
special tokens of their own (decoder-only checkpoints do not name them), and ``auto_map`` (remote
code, which lorafleet never runs).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

GENERIC_CLASS = "TokenizersBackend"  # transformers 5's PreTrainedTokenizerFast
# model_type -> the class AutoTokenizer loads for it whatever the configs name (qwen2 is in
# transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS; mistral's registered class is the generic one).
MODEL_TYPE_CLASSES: Mapping[str, str] = MappingProxyType({"qwen2": "Qwen2Tokenizer", "mistral": GENERIC_CLASS})
# class -> (add bos, add eos) of the post-processor it builds in place of tokenizer.json's.
REBUILT_POST_PROCESSORS: Mapping[str, tuple[bool, bool]] = MappingProxyType({
    "CodeLlamaTokenizer": (True, False),  # its __init__'s add_bos_token=True, passed on explicitly
    "GPTNeoXTokenizer": (False, False),  # its __init__ calls update_post_processor() with both flags gone
})

# class -> the named special tokens its __init__ defaults to (its signature's), which count where
# neither tokenizer_config.json nor special_tokens_map.json has the key (a null there names none).
_ENDOFTEXT = "<|endoftext|>"
CLASS_SPECIAL_TOKENS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    "CodeLlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    "GemmaTokenizer": {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "mask_token": "<mask>"},
    "Qwen2Tokenizer": {"unk_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "pad_token": _ENDOFTEXT},
    "GPT2Tokenizer": {"unk_token": _ENDOFTEXT, "bos_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT},
    "GPTNeoXTokenizer": {"unk_token": _ENDOFTEXT, "bos_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "pad_token": "<|padding|>"},
    "CohereTokenizer": {"unk_token": "<UNK>", "bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>", "pad_token": "<PAD>",
                        "cls_token": "<CLS>", "sep_token": "<SEP>", "mask_token": "<MASK_TOKEN>"},
})


def auto_tokenizer_class(tokenizer_config: Mapping[str, Any], model_config: Mapping[str, Any], byte_level: bool = False) -> str:
    """The class ``AutoTokenizer.from_pretrained`` loads (name without ``Fast``); see the module docstring.
    ``byte_level``: tokenizer.json's text holds ``"ByteLevel"`` (a ByteLevel step anywhere in it)."""
    model_type = model_config.get("model_type")
    if model_type in MODEL_TYPE_CLASSES:
        return MODEL_TYPE_CLASSES[model_type]
    named = tokenizer_config.get("tokenizer_class") or model_config.get("tokenizer_class")
    if not isinstance(named, str) or not named:
        return GENERIC_CLASS
    name = named.removesuffix("Fast")
    if name == "LlamaTokenizer" and byte_level:  # a Llama-3-style file: LlamaTokenizer would rebuild it as SentencePiece's
        return GENERIC_CLASS
    return GENERIC_CLASS if name in ("PreTrainedTokenizer", "PythonBackend") else name
