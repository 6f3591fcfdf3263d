"""Random texts against transformers' ``AutoTokenizer``: for each tokenizer shape the tokenizer
tests build (Llama 2 / TinyLlama files with each ``legacy`` / ``add_prefix_space``, CodeLlama, Gemma,
the byte-level classes, the generic class, the tiny test models), and for added and special tokens
with unusual flags (``lstrip``, ``rstrip``, ``single_word``, ``normalized``, not special), seeded
random strings (pieces the vocabularies hold, special tokens' spellings, whitespace, combining
marks, characters NFC changes, control characters, any code point) must encode, with and without
special tokens, with the same ids and offsets, and those ids and random ids must decode, skipping
special tokens or not, to the same text."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

import pytest

from runtime.tokenizer import Tokenizer
from tests.fixtures.tiny_models import build_tiny_model
from tests.test_tokenizer_class import write_configs as write_class_configs, write_tokenizer
from tests.test_tokenizer_pipeline import BYTE_LEVEL, LLAMA, write_byte_level, write_configs, write_sentencepiece

TEXTS_PER_SHAPE = 120
PIECES = [*"hello wrdINSTthe[]/0123456789.", " ", "  ", "\n", "\t", "\r\n", "<s>", "</s>", "<unk>", "<|im_start|>", "<|endoftext|>",
          "▁", "Ġ", "Ċ", "e\u0301", "é", "Å", "A\u030a", "ﬁ", "Ⅻ", "１２", "日本", "🙂", "👍🏽", "\u200d", "\u00a0", "\u3000", "\u2028",
          "\x00", "\x7f", "\ufeff", "\ufffd", "ß", "İ", "ǅ", "'s", "'LL", "don't", "<|tool|>", " hi!", "hi!", "<x>", "<y>", "<w>",
          "<n>", "a<w>b", "<N>"]


def added_token(content: str, **flags: bool) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False, **flags}


# Extra special tokens with each flag (none says special but <y> and <n>), and two added tokens in
# tokenizer.json that are not special: one normalised, one a single word with a space in it.
EXTRA = {"extra_special_tokens": [added_token("<x>", lstrip=True), added_token("<y>", rstrip=True, special=True),
                                  added_token("<w>", single_word=True), added_token("<n>", normalized=True, special=True)]}


# Named and model-specific special tokens with flags of their own; the pad token is an added token
# tokenizer.json lists as not special.
NAMED = {"bos_token": added_token("<s>", lstrip=True), "eos_token": added_token("</s>", rstrip=True, normalized=True), "pad_token": "<|tool|>",
         "image_token": added_token("<x>", single_word=True)}
# tokenizer_config.json's own list of the added tokens, with other flags than tokenizer.json's.
DECLARED = {"added_tokens_decoder": {"1": {"content": "<s>", "lstrip": False, "rstrip": True, "normalized": False, "single_word": False, "special": True},
                                     "319": {"content": "<|tool|>", "lstrip": True, "rstrip": False, "normalized": False, "single_word": False, "special": False}}}


def with_added_tokens(folder: Path) -> None:
    data = json.loads((folder / "tokenizer.json").read_text())
    first = max(data["model"]["vocab"].values()) + 1 + len(data["added_tokens"])
    data["added_tokens"] += [
        {"id": first, "content": "<|tool|>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": True, "special": False},
        {"id": first + 1, "content": " hi!", "single_word": True, "lstrip": False, "rstrip": False, "normalized": True, "special": False}]
    (folder / "tokenizer.json").write_text(json.dumps(data))


def sentencepiece(legacy_file: bool, tokenizer_config: dict, added: bool = False) -> Callable[[Path], None]:
    def build(folder: Path) -> None:
        write_sentencepiece(folder, legacy_file)
        if added:
            with_added_tokens(folder)
        write_configs(folder, tokenizer_config, "llama")
    return build


def byte_level(shape: str, tokenizer_config: dict, model_type: str, added: bool = False) -> Callable[[Path], None]:
    def build(folder: Path) -> None:
        write_byte_level(folder, shape)
        if added:
            with_added_tokens(folder)
        write_configs(folder, tokenizer_config, model_type)
    return build


def generic(kind: str, tokenizer_class: str | None) -> Callable[[Path], None]:
    def build(folder: Path) -> None:
        write_tokenizer(folder, kind, "bos")
        write_class_configs(folder, tokenizer_class, "llama", (None, None))
    return build


NO_INFILL = dict.fromkeys(["prefix_token", "middle_token", "suffix_token", "eot_token", "fill_token"])
SHAPES: dict[str, Callable[[Path], None]] = {
    **{f"llama-{'legacy' if legacy_file else 'metaspace'}-file-{i}": sentencepiece(legacy_file, {**LLAMA, **flags})
       for legacy_file in (True, False)
       for i, flags in enumerate([{}, {"legacy": True}, {"legacy": False, "add_prefix_space": False}, {"legacy": True, "add_prefix_space": False}])},
    "code-llama": sentencepiece(True, {**LLAMA, "tokenizer_class": "CodeLlamaTokenizer", **NO_INFILL}),
    "gemma": sentencepiece(True, {**LLAMA, "tokenizer_class": "GemmaTokenizerFast", "pad_token": "<unk>", "mask_token": "<unk>"}),
    "qwen2-over-llama3-file": byte_level("llama3", {**BYTE_LEVEL, "tokenizer_class": "LlamaTokenizerFast"}, "qwen2"),
    "qwen2-prefix-space": byte_level("gpt2", {**BYTE_LEVEL, "tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": True}, "qwen2"),
    "qwen3_5": byte_level("llama3", {**BYTE_LEVEL, "tokenizer_class": "Qwen3_5Tokenizer"}, "llama"),
    "gpt2": byte_level("gpt2", {**BYTE_LEVEL, "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": True}, "llama"),
    "gpt-neox": byte_level("llama3", {**BYTE_LEVEL, "tokenizer_class": "GPTNeoXTokenizerFast"}, "llama"),
    "cohere": byte_level("gpt2", {**BYTE_LEVEL, "tokenizer_class": "CohereTokenizerFast", "cls_token": "<s>", "sep_token": "</s>", "mask_token": "</s>"}, "llama"),
    "llama3-byte-level": byte_level("llama3", {**BYTE_LEVEL, "tokenizer_class": "LlamaTokenizerFast"}, "llama"),
    "generic-byte-level": generic("byte_level", None),
    "generic-metaspace": generic("metaspace", None),
    **{f"added-{name}": sentencepiece(legacy_file, {**LLAMA, "tokenizer_class": cls, **EXTRA}, added=True)
       for name, legacy_file, cls in [("llama", True, "LlamaTokenizerFast"), ("generic", False, "PreTrainedTokenizerFast"), ("gemma", True, "GemmaTokenizerFast")]},
    "added-llama-split-special-tokens": sentencepiece(False, {**LLAMA, "split_special_tokens": True, **EXTRA}, added=True),
    **{f"added-{name}": byte_level(shape, {**BYTE_LEVEL, "tokenizer_class": cls, **EXTRA}, model_type, added=True)
       for name, shape, cls, model_type in [("qwen2", "llama3", None, "qwen2"), ("gpt2", "gpt2", "GPT2Tokenizer", "llama"),
                                            ("gpt-neox", "llama3", "GPTNeoXTokenizerFast", "llama"), ("cohere", "gpt2", "CohereTokenizerFast", "llama")]},
    **{f"named-{name}": sentencepiece(True, {**LLAMA, "tokenizer_class": cls, **NO_INFILL, **NAMED, **extra}, added=True)
       for name, cls, extra in [("llama", "LlamaTokenizerFast", EXTRA), ("code-llama", "CodeLlamaTokenizer", {}),
                                ("gemma-split-special-tokens", "GemmaTokenizerFast", {"split_special_tokens": True}),
                                ("generic-declared", None, {**DECLARED, **EXTRA})]},
    **{f"named-{name}": byte_level(shape, {**BYTE_LEVEL, "tokenizer_class": cls, **NAMED, **extra}, model_type, added=True)
       for name, shape, cls, model_type, extra in [("qwen2", "llama3", None, "qwen2", EXTRA), ("gpt2", "gpt2", "GPT2Tokenizer", "llama", {}),
                                                   ("cohere", "gpt2", "CohereTokenizerFast", "llama", EXTRA)]},
    "tiny-llama": lambda folder: build_tiny_model(folder, "llama", seed=0),
    "tiny-qwen2": lambda folder: build_tiny_model(folder, "qwen2", seed=1),
}


def random_text(rng: random.Random) -> str:
    if rng.random() < 0.3:  # any code point but surrogates, control characters included
        ranges = [(0x00, 0x1F), (0x20, 0x7E), (0xA0, 0x2FFF), (0x3000, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
        return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(0, 12)))
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 10)))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_random_texts_encode_and_decode_as_transformers(tmp_path, shape):
    from transformers import AutoTokenizer

    SHAPES[shape](tmp_path)
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    rng = random.Random(shape)
    for _ in range(TEXTS_PER_SHAPE):
        text = random_text(rng)
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref(text, add_special_tokens=special)["input_ids"], (text, special)
        ids = ref(text)["input_ids"]
        assert ours.encode_with_spans(text)[1] == [tuple(s) for s in ref(text, return_offsets_mapping=True)["offset_mapping"]], text
        for decoded in (ids, [rng.randrange(len(ref)) for _ in range(rng.randint(1, 8))]):
            for skip in (True, False):
                assert ours.decode(decoded, skip_special_tokens=skip) == ref.decode(decoded, skip_special_tokens=skip), (decoded, skip)
