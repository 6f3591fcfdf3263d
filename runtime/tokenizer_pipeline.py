"""Tokenizer pipeline: the BPE options, normaliser, pre-tokenizer and decoder that transformers 5's
tokenizer classes build in place of tokenizer.json's (checked with transformers 5.24).

A class with an ``__init__`` of its own keeps only tokenizer.json's vocabulary, merges and
post-processor (``TokenizersBackend.convert_to_native_format``; of its added tokens, only those
tokenizer_config.json declares come back: ``runtime.tokenizer_rebuild``): its ``__init__`` builds a new
``BPE`` model with its own options (any option it does not pass takes ``BPE``'s default) and its own
normaliser, pre-tokenizer and decoder, from tokenizer_config.json's flags and its defaults. The
prompt ids then follow the class, not tokenizer.json. ``REBUILT_PIPELINES`` holds, per class, what
its ``__init__`` builds (``models/<name>/tokenization_<name>.py``):

- ``LlamaTokenizer``: no normaliser; ``Metaspace("▁", prepend_scheme, split=False)``, whose scheme
  is ``"first"`` (``legacy``: false or absent, the class default), ``"always"`` (``legacy: true``) or
  ``"never"`` (``add_prefix_space: false``; absent is true); decoder ``Replace("▁", " ")``,
  ``ByteFallback``, ``Fuse``, then ``Strip(" ", 1, 0)`` unless ``add_prefix_space`` is false; BPE with
  ``fuse_unk`` and ``byte_fallback`` and no unk token. A Llama-2 tokenizer.json converted the legacy
  way (normaliser ``Prepend("▁")`` + ``Replace(" ", "▁")``, as Llama 2 and TinyLlama ship it) with
  ``legacy: false`` in tokenizer_config.json: ``"<s>[INST] hi"`` is ``<s>``, ``[``, ... (no ``▁`` after a
  special token in the text) and ``" hi"`` is ``▁hi`` (the normaliser made it ``▁▁hi``).
- ``CodeLlamaTokenizer``: as Llama with ``"first"`` / ``"never"`` (no ``legacy``), the ``Strip`` always,
  and the unk token (``unk_token``, default ``<unk>``) in the BPE.
- ``GemmaTokenizer``: normaliser ``Replace(" ", "▁")``; ``Split(" ", "merged_with_previous")``; decoder
  ``Replace``, ``ByteFallback``, ``Fuse``; BPE with ``fuse_unk``, ``byte_fallback`` and the unk token.
- ``Qwen2Tokenizer``: ``NFC``; ``Split(Qwen2's regex, "isolated")`` then ``ByteLevel(add_prefix_space,
  use_regex=False)``; decoder ``ByteLevel``; BPE with empty subword prefix / suffix. ``model_type:
  qwen2`` loads it whatever tokenizer.json says (``runtime.tokenizer_class``).
- ``Qwen3_5Tokenizer``: Qwen2's steps with its own regex, which keeps combining marks (Unicode category M)
  with the letters before them; the ``qwen3_5`` model types load it whatever the configs name.
- ``GPT2Tokenizer``: ``ByteLevel(add_prefix_space)``, decoder ``ByteLevel``, no normaliser;
  ``GPTNeoXTokenizer`` the same after ``NFC`` (and ``trim_offsets``); ``CohereTokenizer`` ``NFC``,
  ``Digits(individual_digits=True)`` then ``ByteLevel(add_prefix_space, trim_offsets=True)``, decoder
  ``ByteLevel(add_prefix_space, trim_offsets=True)``. ``add_prefix_space`` is false unless set.

On real checkpoints: Llama 2 and TinyLlama (legacy-converted tokenizer.json) change, whatever
``legacy`` says, where the text or a part of it after a special token starts with a space
(``" hi"``: ``▁hi``, not ``▁``, ``▁hi``), and with ``legacy`` false or absent (their configs) for
every part after a special token, so for every prompt their chat templates render; Gemma, Qwen2
and GPT-2 files are built as their classes build them, so their ids stay; a qwen2 checkpoint with
another pre-tokenizer (DeepSeek-R1-Distill-Qwen's: digits in threes, no NFC) gets Qwen2's, and
``add_prefix_space: false`` now counts. A class not listed keeps tokenizer.json's steps, as
``TokenizersBackend`` does; transformers' other classes that rebuild theirs (encoder and seq2seq
classes, ``BertTokenizer``, ``T5Tokenizer``, ...) are refused when the tokenizer loads
(``runtime.tokenizer_class.REBUILDING_CLASSES_NOT_REPRODUCED``). The rebuilt model is a BPE: a rebuilding class over another model (a Unigram
tokenizer.json) is refused (``PipelineError``), where transformers would read the vocabulary as a
BPE's without merges.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

METASPACE = "\u2581"  # SentencePiece's visible space, "▁"
# Qwen2Tokenizer's PRETOKENIZE_REGEX (models/qwen2/tokenization_qwen2.py).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3_5Tokenizer's (models/qwen3_5/tokenization_qwen3_5.py): Qwen2's, with combining marks (\p{M})
# read as part of a word (``x\u0301`` is one piece there, two in Qwen2's).
QWEN3_5_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# ``tokenizers.models.BPE``'s options and their defaults: what a class's ``BPE(...)`` leaves unset.
BPE_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
    "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
})


class PipelineError(ValueError):
    """A checkpoint whose tokenizer class rebuilds a pipeline lorafleet cannot rebuild likewise."""


@dataclass(frozen=True)
class Pipeline:
    """What a class's ``__init__`` builds: ``bpe`` the options it passes to ``BPE`` (the others take
    ``BPE_DEFAULTS``), then the normaliser, pre-tokenizer and decoder (None: none)."""

    normalizer: Any
    pre_tokenizer: Any
    decoder: Any
    bpe: Mapping[str, Any] = field(default_factory=dict)


def _flag(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    """tokenizer_config's ``key``, ``default`` when absent or null (the classes' ``x if x is not None else d``)."""
    value = cfg.get(key)
    return default if value is None else bool(value)


def _unk(cfg: Mapping[str, Any], default: str) -> str:
    value = cfg.get("unk_token", default)
    return str(value.get("content") if isinstance(value, dict) else value)


def _spm_decoder(strip: bool) -> Any:
    from tokenizers import decoders

    steps = [decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if strip else []))


def _llama(cfg: Mapping[str, Any]) -> Pipeline:
    from tokenizers import pre_tokenizers

    add_prefix_space = _flag(cfg, "add_prefix_space", True)
    # transformers' _get_prepend_scheme, with LlamaTokenizer's legacy=False default
    scheme = ("first" if not cfg.get("legacy", False) else "always") if add_prefix_space else "never"
    return Pipeline(None, pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme=scheme, split=False),
                    _spm_decoder(add_prefix_space), {"fuse_unk": True, "byte_fallback": True})


def _code_llama(cfg: Mapping[str, Any]) -> Pipeline:
    from tokenizers import pre_tokenizers

    scheme = "first" if _flag(cfg, "add_prefix_space", True) else "never"
    return Pipeline(None, pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme=scheme, split=False),
                    _spm_decoder(True), {"fuse_unk": True, "byte_fallback": True, "unk_token": _unk(cfg, "<unk>")})


def _gemma(cfg: Mapping[str, Any]) -> Pipeline:
    from tokenizers import decoders, normalizers, pre_tokenizers

    return Pipeline(normalizers.Replace(" ", METASPACE),
                    pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False),
                    decoders.Sequence([decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]),
                    {"fuse_unk": True, "byte_fallback": True, "unk_token": _unk(cfg, "<unk>")})


BYTE_LEVEL_BPE: Mapping[str, Any] = MappingProxyType({"continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False})


def _qwen_steps(cfg: Mapping[str, Any], regex: str) -> Pipeline:
    """Qwen2Tokenizer's steps, and Qwen3_5Tokenizer's: they differ only in the splitting ``regex``."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    return Pipeline(normalizers.NFC(), pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=_flag(cfg, "add_prefix_space", False), use_regex=False),
    ]), decoders.ByteLevel(), BYTE_LEVEL_BPE)


def _qwen2(cfg: Mapping[str, Any]) -> Pipeline:
    return _qwen_steps(cfg, QWEN2_PRETOKENIZE_REGEX)


def _qwen3_5(cfg: Mapping[str, Any]) -> Pipeline:
    return _qwen_steps(cfg, QWEN3_5_PRETOKENIZE_REGEX)


def _gpt2(cfg: Mapping[str, Any]) -> Pipeline:
    from tokenizers import decoders, pre_tokenizers

    return Pipeline(None, pre_tokenizers.ByteLevel(add_prefix_space=bool(cfg.get("add_prefix_space", False))), decoders.ByteLevel(), BYTE_LEVEL_BPE)


def _gpt_neox(cfg: Mapping[str, Any]) -> Pipeline:
    from tokenizers import decoders, normalizers, pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=bool(cfg.get("add_prefix_space", False)), trim_offsets=bool(cfg.get("trim_offsets", True)))
    return Pipeline(normalizers.NFC(), pre, decoders.ByteLevel(), BYTE_LEVEL_BPE)


def _cohere(cfg: Mapping[str, Any]) -> Pipeline:
    from tokenizers import decoders, normalizers, pre_tokenizers

    add_prefix_space = bool(cfg.get("add_prefix_space", False))
    pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                   pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, trim_offsets=True)])
    return Pipeline(normalizers.NFC(), pre, decoders.ByteLevel(add_prefix_space=add_prefix_space, trim_offsets=True), BYTE_LEVEL_BPE)


# class (name without "Fast") -> its pipeline, from tokenizer_config.json.
REBUILT_PIPELINES: Mapping[str, Callable[[Mapping[str, Any]], Pipeline]] = MappingProxyType({
    "LlamaTokenizer": _llama,
    "CodeLlamaTokenizer": _code_llama,
    "GemmaTokenizer": _gemma,
    "Qwen2Tokenizer": _qwen2,
    "Qwen3_5Tokenizer": _qwen3_5,
    "GPT2Tokenizer": _gpt2,
    "GPTNeoXTokenizer": _gpt_neox,
    "CohereTokenizer": _cohere,
})


def rebuild_pipeline(tok: Any, tokenizer_class: str, tokenizer_config: Mapping[str, Any], source: str) -> None:
    """Give ``tok`` (``runtime.tokenizer_rebuild.fresh_backend`` of tokenizer.json, named ``source`` in
    errors) the pipeline ``tokenizer_class`` builds, in place: its vocabulary, merges and
    post-processor stay. A class not in ``REBUILT_PIPELINES`` leaves it as it is."""
    build = REBUILT_PIPELINES.get(tokenizer_class)
    if build is None:
        return
    model = type(tok.model).__name__
    if model != "BPE":
        raise PipelineError(
            f"{source}: a {model} model, which transformers' {tokenizer_class} rebuilds as a BPE model without merges; "
            "lorafleet does not reproduce that (name the class that fits the file, or none, in tokenizer_config.json)")
    pipeline = build(tokenizer_config)
    for option, default in BPE_DEFAULTS.items():
        setattr(tok.model, option, pipeline.bpe.get(option, default))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = pipeline.normalizer, pipeline.pre_tokenizer, pipeline.decoder
