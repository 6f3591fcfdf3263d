"""Prompt ids, offsets and decoded text against transformers' ``AutoTokenizer`` on folders shaped like
real checkpoints, for the tokenizer classes that build their own normaliser / pre-tokenizer /
decoder / BPE options in place of tokenizer.json's (runtime.tokenizer_pipeline): Llama 2 and
TinyLlama (tokenizer.json converted the legacy way, ``legacy`` false / true / absent,
``add_prefix_space``), CodeLlama, a qwen2 checkpoint whose tokenizer.json has another
pre-tokenizer (DeepSeek-R1-Distill-Qwen's shape), Qwen3.5 (combining marks), and GPT-2 / GPT-NeoX / Cohere / Gemma over files
that do not match them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.detokenizer import IncrementalDetokenizer
from runtime.tokenizer import Tokenizer, TokenizerError

WORDS = ["hi", "hello", "world", "INST", "the"]
TEXTS = ["hi", " hi", "  hi", "hi ", " ", "", "hello world", "x  y", "a\nb", "\n\nhi", "<s>hi", "<s> hi",
         "<s>[INST] hi [/INST]", "</s><s>[INST] hello", "hi</s>", "héllo ✓ 日本", "e\u0301 café", "12345 6.7",
         "<|im_start|>user\nhi<|im_end|>\n", "don't  stop\n\n\n 2024"]
LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def with_merges(words: list[str], vocab: dict[str, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """``vocab`` plus each word's characters and left-to-right prefixes, and the merges that build them."""
    vocab, merges = dict(vocab), []
    for word in words:
        for ch in word:
            vocab.setdefault(ch, len(vocab))
        for i in range(2, len(word) + 1):
            if word[:i] not in vocab:
                vocab[word[:i]] = len(vocab)
                merges.append((word[: i - 1], word[i - 1]))
    return vocab, merges


def write_sentencepiece(folder: Path, legacy_file: bool) -> None:
    """A Llama-2-style tokenizer.json (LlamaConverter's): <unk> <s> </s>, the 256 byte-fallback pieces,
    ``▁word`` pieces; normaliser ``Prepend("▁")`` + ``Replace(" ", "▁")`` when ``legacy_file`` (as Llama 2
    and TinyLlama ship it), else ``Metaspace(prepend_scheme="first")``; bos first."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers, processors

    base = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "▁": 259}
    vocab, merges = with_merges(["▁" + w for w in WORDS] + WORDS + ["▁[", "[", "]"] + list("0123456789."), base)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if legacy_file:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))


def write_byte_level(folder: Path, shape: str) -> None:
    """A byte-level BPE tokenizer.json: ``shape`` "llama3" (Split on Llama 3's regex, digits in threes,
    no NFC; DeepSeek-R1-Distill-Qwen's is alike) or "gpt2" (ByteLevel with its own regex); special
    tokens <|endoftext|> <|im_start|> <|im_end|> <s> </s>, no post-processor."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    base = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab, merges = with_merges(["Ġ" + w for w in WORDS] + WORDS + ["123", "ĊĊ", "ĠĠ"], base)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix=""))
    if shape == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))


def write_configs(folder: Path, tokenizer_config: dict, model_type: str) -> None:
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))


def assert_as_transformers(folder: Path) -> None:
    """encode (with and without special tokens), encode_with_spans, decode (skipping special tokens
    or not) and streamed text all as transformers' on every text."""
    from transformers import AutoTokenizer

    ours, ref = Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref(text, add_special_tokens=special)["input_ids"], (text, special)
        ids = ref(text)["input_ids"]
        spans = [tuple(s) for s in ref(text, return_offsets_mapping=True)["offset_mapping"]]
        assert ours.encode_with_spans(text) == (ids, spans), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)
        # The prompt "hello" then ``ids`` streamed one token at a time, as the engine decodes an output.
        prompt = ours.encode("hello")
        detok = IncrementalDetokenizer(lambda t: ours.decode(t, skip_special_tokens=True), prompt_ids=prompt)
        for n in range(1, len(ids) + 1):
            detok.add_tokens(ids[:n])
        detok.finish_pending(ids)
        whole, head = ref.decode(prompt + ids, skip_special_tokens=True), ref.decode(prompt, skip_special_tokens=True)
        assert detok.text == whole[len(head):], text


LLAMA = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


@pytest.mark.parametrize("flags", [{}, {"legacy": False}, {"legacy": True}, {"legacy": False, "add_prefix_space": False},
                                   {"legacy": True, "add_prefix_space": False}])
@pytest.mark.parametrize("legacy_file", [True, False])
def test_llama_tokenizer_builds_its_own_metaspace_steps(tmp_path, legacy_file, flags):
    """Llama 2 / TinyLlama: ``legacy: false`` puts no ▁ after a special token in the text, " hi" is ▁hi
    (the file's normaliser made it ▁▁hi), ``add_prefix_space: false`` adds no ▁ and strips none."""
    write_sentencepiece(tmp_path, legacy_file)
    write_configs(tmp_path, {**LLAMA, **flags}, "llama")
    assert_as_transformers(tmp_path)


@pytest.mark.parametrize("flags", [{}, {"add_prefix_space": False}])
def test_code_llama_tokenizer_builds_its_own_metaspace_steps(tmp_path, flags):
    write_sentencepiece(tmp_path, legacy_file=True)
    no_infill_tokens = dict.fromkeys(["prefix_token", "middle_token", "suffix_token", "eot_token", "fill_token"])
    write_configs(tmp_path, {**LLAMA, "tokenizer_class": "CodeLlamaTokenizer", **no_infill_tokens, **flags}, "llama")
    assert_as_transformers(tmp_path)


BYTE_LEVEL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}


@pytest.mark.parametrize("shape, tokenizer_config, model_type", [
    # model_type qwen2 loads Qwen2Tokenizer: its regex (digits one by one) and NFC, whatever the file has
    ("llama3", {**BYTE_LEVEL, "tokenizer_class": "LlamaTokenizerFast"}, "qwen2"),
    ("gpt2", {**BYTE_LEVEL, "tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": True}, "qwen2"),
    ("gpt2", {**BYTE_LEVEL, "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": True}, "llama"),
    ("llama3", {**BYTE_LEVEL, "tokenizer_class": "GPTNeoXTokenizerFast"}, "llama"),
    ("gpt2", {**BYTE_LEVEL, "tokenizer_class": "CohereTokenizerFast", "cls_token": "<s>", "sep_token": "</s>", "mask_token": "</s>"}, "llama"),
    ("llama3", {**BYTE_LEVEL, "tokenizer_class": "LlamaTokenizerFast"}, "llama"),  # ByteLevel: TokenizersBackend, the file's own steps
])
def test_byte_level_classes_build_their_own_steps(tmp_path, shape, tokenizer_config, model_type):
    write_byte_level(tmp_path, shape)
    write_configs(tmp_path, tokenizer_config, model_type)
    assert_as_transformers(tmp_path)


MARKED = ["x\u0301", "q\u0303", "के"]  # combining marks that NFC leaves after their letter


def with_marked_words(folder: Path) -> None:
    """tokenizer.json with pieces and merges for ``MARKED``'s words, letters and marks together (as
    Qwen3.5's vocabulary has them), so the splitting regex decides whether they merge."""
    from tokenizers import pre_tokenizers

    data = json.loads((folder / "tokenizer.json").read_text())
    model = data["model"]
    words = [piece for word in MARKED for piece, _ in pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(word)]
    vocab, merges = with_merges(words, {k: v for k, v in model["vocab"].items() if k not in {t["content"] for t in data["added_tokens"]}})
    first = len(vocab)
    for i, token in enumerate(data["added_tokens"]):
        token["id"] = first + i
    model["vocab"], model["merges"] = vocab, [*model["merges"], *merges]
    (folder / "tokenizer.json").write_text(json.dumps(data))


@pytest.mark.parametrize("model_type, tokenizer_class", [
    ("llama", "Qwen3_5Tokenizer"),  # a llama checkpoint naming it: the class named
    ("qwen3_5", "Qwen2Tokenizer"),  # the qwen3_5 types load it whatever they name, as qwen2 loads Qwen2Tokenizer
])
def test_qwen3_5_tokenizer_builds_its_own_steps(tmp_path, model_type, tokenizer_class):
    """Qwen3_5Tokenizer: Qwen2's steps with combining marks kept in their word (lorafleet refused the
    class). The marked words are one token each there, and several under Qwen2Tokenizer."""
    from transformers import AutoTokenizer

    write_byte_level(tmp_path, "llama3")
    with_marked_words(tmp_path)
    write_configs(tmp_path, {**BYTE_LEVEL, "tokenizer_class": tokenizer_class, "eos_token": "<|im_end|>"}, model_type)
    assert_as_transformers(tmp_path)
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ref).__name__ == ours.tokenizer_class == "Qwen3_5Tokenizer"
    for text in [*MARKED, " x\u0301y", "a के b", "hix\u0301q\u0303"]:
        assert ours.encode_with_spans(text) == (ref(text)["input_ids"], [tuple(s) for s in ref(text, return_offsets_mapping=True)["offset_mapping"]])
    assert [len(ours.encode(word)) for word in MARKED] == [1, 1, 1]
    write_configs(tmp_path, {**BYTE_LEVEL, "tokenizer_class": "Qwen2Tokenizer"}, "qwen2")
    assert all(len(Tokenizer(tmp_path).encode(word)) > 1 for word in MARKED)


def test_gemma_tokenizer_builds_its_own_steps(tmp_path):
    write_sentencepiece(tmp_path, legacy_file=True)
    write_configs(tmp_path, {**LLAMA, "tokenizer_class": "GemmaTokenizerFast", "pad_token": "<unk>", "mask_token": "<unk>"}, "llama")
    assert_as_transformers(tmp_path)


def test_a_rebuilding_class_over_a_unigram_file_is_refused(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, models

    HFTokenizer(models.Unigram([("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), ("a", -1.0)], unk_id=0)).save(str(tmp_path / "tokenizer.json"))
    write_configs(tmp_path, LLAMA, "llama")
    with pytest.raises(TokenizerError, match="Unigram model, which transformers' LlamaTokenizer rebuilds as a BPE"):
        Tokenizer(tmp_path)
