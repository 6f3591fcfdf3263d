"""The detokenizer decodes output tokens to the right of the prompt's last tokens.

SentencePiece / Metaspace decoders (Llama-2, Mistral v0.x, Gemma) drop the leading space of
the first token of a decode call, so without prompt context " Paris" after "The capital of
France is" came back as "Paris". The rule checked here is the standard definition:
``text == decode(prompt + output)[len(decode(prompt)):]``. Byte-level BPE output must not
change.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from runtime.bench.synthetic import write_byte_tokenizer
from runtime.detokenizer import IncrementalDetokenizer
from runtime.request import SamplingParams
from runtime.tokenizer import Tokenizer
from tests.engine_helpers import make_engine, run_to_completion
from tests.fixtures.tiny_models import TINY_DIMS, build_tiny_model

WORDS = ["▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", ".", ",", "▁café", "é", "▁Hello", "▁world"]


def save_with_specials(tok, out_dir: Path) -> None:
    """Add <s>, </s>, <pad> as special tokens and a post-processor that puts <s> first, save ``tok``
    and a tokenizer_config.json naming them."""
    from tokenizers import processors

    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[bos])
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg))


def write_metaspace_tokenizer(out_dir: Path, vocab_size: int = TINY_DIMS["vocab_size"]) -> None:
    """A SentencePiece-style tokenizer: WordLevel + Metaspace pre-tokenizer and decoder.

    ``vocab_size`` tokens; ids 256/257/258 are <s>/</s>/<pad> like the tiny models' config.
    Most fillers start with "▁" (a word), some do not (a word piece).
    """
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    pieces = ["<unk>", *WORDS]
    pieces += [f"▁w{i}" if i % 3 else f"p{i}" for i in range(256 - len(pieces))]
    pieces += ["<s>", "</s>", "<pad>"]
    pieces += [f"▁v{i}" for i in range(vocab_size - len(pieces))]
    vocab = {p: i for i, p in enumerate(pieces)}
    assert vocab["<s>"] == 256 and len(vocab) == vocab_size
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    save_with_specials(tok, out_dir)


@pytest.fixture(scope="module")
def metaspace_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = build_tiny_model(tmp_path_factory.mktemp("tiny_metaspace"), "llama", seed=3)
    write_metaspace_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def metaspace_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("metaspace_tok")
    write_metaspace_tokenizer(out)
    return Tokenizer(out)


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("byte_tok")
    write_byte_tokenizer(out, TINY_DIMS["vocab_size"])
    return Tokenizer(out)


def standard_text(tok: Tokenizer, prompt_ids, output_ids) -> str:
    return tok.decode([*prompt_ids, *output_ids])[len(tok.decode(prompt_ids)) :]


def stream(tok: Tokenizer, prompt_ids, output_ids, stop=(), context=True) -> tuple[str, bool]:
    """Feed ``output_ids`` one at a time like the engine; returns (emitted text, stopped)."""
    d = IncrementalDetokenizer(tok.decode, stop, prompt_ids if context else ())
    emitted = ""
    for n in range(1, len(output_ids) + 1):
        d.add_tokens(output_ids[:n])
        if n == len(output_ids):
            d.finish_pending(output_ids)
        emitted += d.take_delta(finished=n == len(output_ids) or d.stopped)
        if d.stopped:
            break
    assert emitted == d.text
    return emitted, d.stopped


def test_metaspace_completion_keeps_its_leading_space(metaspace_tokenizer):
    tok = metaspace_tokenizer
    prompt = tok.encode("The capital of France is")
    output = [tok.token_to_id("▁Paris"), tok.token_to_id(".")]
    assert stream(tok, prompt, output) == (" Paris.", False)
    assert standard_text(tok, prompt, output) == " Paris."


@pytest.mark.parametrize(
    "stop, expected",
    [((" Paris",), ""), ((".",), " Paris"), (("s. c",), " Pari"), (("café",), " Paris. ")],
)
def test_metaspace_stop_strings_cut_the_text_with_context(metaspace_tokenizer, stop, expected):
    tok = metaspace_tokenizer
    prompt = tok.encode("The capital of France is")
    output = [tok.token_to_id(t) for t in ("▁Paris", ".", "▁café", "▁Hello", "▁world")]
    assert stream(tok, prompt, output, stop) == (expected, True)


def test_metaspace_only_special_tokens_in_prompt(metaspace_tokenizer):
    """Prompt = [<s>]: its text is empty, so the standard definition drops the space too."""
    tok = metaspace_tokenizer
    output = [tok.token_to_id("▁Hello"), tok.token_to_id("▁world")]
    assert stream(tok, [tok.bos_token_id], output)[0] == standard_text(tok, [tok.bos_token_id], output) == "Hello world"


@pytest.mark.parametrize("prompt", ["The capital of France is", "Hello", "café , The world"])
def test_engine_text_is_the_standard_definition_metaspace(metaspace_model_dir, prompt):
    engine = make_engine(metaspace_model_dir)
    tok = engine.tokenizer
    prompt_ids = tok.encode(prompt)
    for i in range(4):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=i))
    finals = run_to_completion(engine)
    for out in finals.values():
        assert out.text == standard_text(tok, prompt_ids, out.token_ids), out.token_ids
    assert any(out.text.startswith(" ") for out in finals.values()), "the check needs a completion starting with a word"


def test_engine_text_is_unchanged_byte_level(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    tok = engine.tokenizer
    prompt = "Hello, wörld €"
    prompt_ids = tok.encode(prompt)
    for i in range(4):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=i))
    for out in run_to_completion(engine).values():
        assert out.text == tok.decode(out.token_ids) == standard_text(tok, prompt_ids, out.token_ids)


def test_byte_level_streams_are_unchanged_by_context(byte_tokenizer):
    """Random byte tokens (split and invalid UTF-8 included), random prompts (some ending inside
    a character): the emitted text with context equals the text without it, token by token."""
    tok = byte_tokenizer
    rng = random.Random(0)
    euro = tok.encode("€", add_special_tokens=False)
    assert len(euro) == 3
    for _ in range(300):
        prompt = [tok.bos_token_id] + [rng.randrange(256) for _ in range(rng.randint(0, 8))]
        if rng.random() < 0.3:
            prompt += euro[: rng.randint(1, 2)]  # the prompt ends inside a character
        output = [rng.randrange(256) for _ in range(rng.randint(1, 10))]
        if rng.random() < 0.5:
            output[rng.randrange(len(output)) :] = euro  # a character split over output tokens
        stop = rng.choice([(), ("a",), ("€",), ("\ufffd",)])
        assert stream(tok, prompt, output, stop) == stream(tok, prompt, output, stop, context=False)


def test_byte_level_multibyte_character_waits_for_its_last_token(byte_tokenizer):
    tok = byte_tokenizer
    prompt = tok.encode("price:")
    euro = tok.encode(" €", add_special_tokens=False)
    d = IncrementalDetokenizer(tok.decode, (), prompt)
    for n in range(1, len(euro)):
        d.add_tokens(euro[:n])
        assert d.take_delta(finished=False) == ("" if n > 1 else " ")
    d.add_tokens(euro)
    assert d.take_delta(finished=False) == "€" and d.text == " €"


def write_byte_fallback_tokenizer(out_dir: Path) -> None:
    """Llama-2's decoder (▁ -> space, byte fallback, strip the first space) over whole words
    and the 256 byte pieces: CJK and emoji are byte runs. Ids 256/257/258 are <s>/</s>/<pad>."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers

    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["<s>", "</s>", "<pad>", "▁", "▁Hello", "▁world", "▁Say"]
    pieces += [f"▁v{i}" for i in range(TINY_DIMS["vocab_size"] - len(pieces))]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    save_with_specials(tok, out_dir)


@pytest.fixture(scope="module")
def byte_fallback_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("byte_fallback_tok")
    write_byte_fallback_tokenizer(out)
    return Tokenizer(out)


def byte_run(tok: Tokenizer, text: str) -> list[int]:
    return [tok.token_to_id(f"<0x{b:02X}>") for b in text.encode("utf-8")]


@pytest.mark.parametrize("tail", ["日本", "🎉🎉", "日", "é日本"])
def test_a_prompt_ending_in_byte_fallback_characters_keeps_the_completions_space(byte_fallback_tokenizer, tail):
    """The last 5 prompt tokens can start inside a character (two CJK characters are 6 byte
    pieces): ByteFallback then decodes the whole run, the complete last character too, as U+FFFD,
    and the context used to be dropped, so the Strip decoder ate the completion's first space."""
    tok = byte_fallback_tokenizer
    prompt = [tok.bos_token_id, tok.token_to_id("▁Say"), tok.token_to_id("▁"), *byte_run(tok, tail)]
    assert tok.decode(prompt) == "Say " + tail
    output = [tok.token_to_id("▁Hello"), tok.token_to_id("▁world")]
    assert stream(tok, prompt, output) == (" Hello world", False)
    assert standard_text(tok, prompt, output) == " Hello world"


def test_byte_fallback_streams_match_the_standard_definition(byte_fallback_tokenizer):
    """Random prompts of words and byte-run characters, random outputs (characters split over
    byte pieces included): the streamed text is the standard definition whenever that is valid text."""
    tok = byte_fallback_tokenizer
    rng = random.Random(1)
    chars = ["日", "本", "🎉", "é", "a", " "]
    words = [tok.token_to_id(w) for w in ("▁Hello", "▁world", "▁Say", "▁")]
    checked = 0
    for _ in range(300):
        prompt = [tok.bos_token_id]
        for _ in range(rng.randint(1, 5)):
            prompt += [rng.choice(words)] if rng.random() < 0.4 else byte_run(tok, rng.choice(chars))
        output = []
        for _ in range(rng.randint(1, 4)):
            output += [rng.choice(words)] if rng.random() < 0.5 else byte_run(tok, rng.choice(chars))
        expected = standard_text(tok, prompt, output)
        if "\ufffd" in tok.decode(prompt + output):
            continue
        assert stream(tok, prompt, output)[0] == expected, (prompt, output)
        checked += 1
    assert checked > 250


def test_min_tokens_ignores_a_shorter_stop_string_generated_before_it():
    """With min_tokens, a stop string must end in text generated from that point on. The search
    started ``len(longest stop) - 1`` characters back for every stop, so a shorter one lying wholly
    before the point still stopped the request (vLLM: each stop from ``len(stop) - 1`` back)."""
    letters = {1: "x", 2: "y", 3: "z"}
    decode = lambda ids: "".join(letters[i] for i in ids)  # noqa: E731
    for stop in (("x",), ("x", "NEVER"), ("NEVER", "x")):
        d = IncrementalDetokenizer(decode, stop, (), min_tokens=2)
        d.add_tokens([1])
        d.add_tokens([1, 2])
        assert (d.text, d.stopped) == ("xy", False), stop
        d.add_tokens([1, 2, 1])
        assert (d.text, d.stopped) == ("xy", True), stop
    d = IncrementalDetokenizer(decode, ("xy", "NEVER"), (), min_tokens=2)  # a stop that spans the point still counts
    d.add_tokens([1])
    d.add_tokens([1, 2])
    assert (d.text, d.stopped) == ("", True)
