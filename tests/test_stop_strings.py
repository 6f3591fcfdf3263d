"""Stop strings end generation at the token that completes them, on a byte-level BPE whose tokens
split characters: one token can end a stop string and start the next character (GPT-2's ``.âĢ``,
the bytes ``.\\xe2\\x80`` of ``.”``).

The model is scripted: ``scripted_engine`` makes the tiny llama's logits pick the given tokens one
after another, so the engine's tokens, text, finish reason and logprobs can be checked exactly.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import pytest
import torch

from runtime.detokenizer import IncrementalDetokenizer
from runtime.engine import LLMEngine
from runtime.request import RequestOutput, SamplingParams
from runtime.tokenizer import Tokenizer
from tests.engine_helpers import make_engine

# Byte-level BPE merges (GPT-2's alphabet): "âĢ" is the bytes E2 80 (the start of ” and —), ".âĢ" is
# "." and those two bytes in one token.
MERGES = [("â", "Ģ"), (".", "âĢ")]


def write_split_character_tokenizer(out_dir: Path) -> None:
    """The 256 byte symbols, <s> </s> <pad> (256-258), then the ``MERGES`` tokens (259, 260)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors

    vocab = {sym: i for i, sym in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])])
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def split_model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("split_chars") / "model"
    shutil.copytree(tiny_llama_dir, out)
    write_split_character_tokenizer(out)
    return out


def scripted_engine(model_dir: Path, prompt_len: int, script: Sequence[int], monkeypatch: pytest.MonkeyPatch) -> LLMEngine:
    """An engine whose model gives the k-th generated token of a ``prompt_len``-token prompt as ``script[k]``
    (logit 0 for it, -30 for every other token; one request at a time)."""
    engine = make_engine(model_dir)
    real_execute = engine.runner.execute

    def execute(steps):
        logits = real_execute(steps).clone()
        for row, step in enumerate(steps):
            logits[row] = -30.0
            logits[row, script[step.start_pos + len(step.token_ids) - prompt_len]] = 0.0
        return logits

    monkeypatch.setattr(engine.runner, "execute", execute)
    return engine


def generate(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine.add_request("r", prompt_ids, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


@pytest.fixture(scope="module")
def split_tokenizer(split_model_dir: Path) -> Tokenizer:
    return Tokenizer(split_model_dir)


def test_the_tokenizer_splits_the_character(split_tokenizer):
    tok = split_tokenizer
    ids = tok.encode("Hi.” Ok", add_special_tokens=False)
    assert [tok.token_bytes(i) for i in ids] == [b"H", b"i", b".\xe2\x80", b"\x9d", b" ", b"O", b"k"]


@pytest.mark.parametrize("stop, include, text", [
    (".", False, "Hi"), (".", True, "Hi."), ("i.", False, "H"), (("x", "i."), False, "H"),
])
def test_a_stop_string_before_a_split_character_stops_at_its_own_token(split_tokenizer, stop, include, text):
    """Token 3 is ``.\\xe2\\x80``: its "." completes the stop string, its two bytes start ”. The
    detokenizer waited for the character to end before it searched, and stopped at token 4."""
    tok = split_tokenizer
    ids = tok.encode("Hi.” Ok", add_special_tokens=False)
    d = IncrementalDetokenizer(tok.decode, (stop,) if isinstance(stop, str) else stop, tok.encode("Say"), include)
    for n in range(1, len(ids) + 1):
        d.add_tokens(ids[:n])
        if d.stopped:
            break
    assert (n, d.text, d.take_delta(finished=False)) == (3, text, text)


def test_the_engine_stops_at_the_token_that_completes_the_stop_string(split_model_dir, split_tokenizer, monkeypatch):
    """What a client sees: the tokens (``usage.completion_tokens``, ``token_ids``) and the logprob
    entries end with the token that completed the stop string; the ” token after it is not generated."""
    tok = split_tokenizer
    script = tok.encode("Hi.” Ok", add_special_tokens=False)
    prompt = tok.encode("Say")
    engine = scripted_engine(split_model_dir, len(prompt), script, monkeypatch)
    for include, text in ((False, "Hi"), (True, "Hi.")):
        params = SamplingParams(max_tokens=7, stop=(".",), include_stop_str_in_output=include, logprobs=0)
        outs = generate(engine, prompt, params)
        final = outs[-1]
        assert (final.text, final.finish_reason, final.token_ids) == (text, "stop", tuple(script[:3]))
        assert [e.token_id for e in final.logprobs] == script[:3]
        assert "".join(out.new_text for out in outs) == text
    engine.close()


@pytest.mark.parametrize("kwargs, text, n_tokens", [
    (dict(stop=("H",)), "", 1),  # the very first token completes it: no text, one token
    (dict(stop=("” O", "i.")), "H", 3),  # several: the first completed ends the reply (earliest, then longest)
    (dict(stop=("”",)), "Hi.", 4),  # a stop string that is a split character ends at its last byte
    (dict(stop_token_ids=(251,), include_stop_str_in_output=True), "Hi.”", 4),  # the token that completes ” keeps it
])
def test_stop_cases_on_split_characters(split_model_dir, split_tokenizer, monkeypatch, kwargs, text, n_tokens):
    """Streamed and whole text agree, the reply ends at the token that ends it, and every token
    up to it is counted."""
    tok = split_tokenizer
    script = tok.encode("Hi.” Ok", add_special_tokens=False)
    prompt = tok.encode("Say")
    engine = scripted_engine(split_model_dir, len(prompt), script, monkeypatch)
    outs = generate(engine, prompt, SamplingParams(max_tokens=7, **kwargs))
    final = outs[-1]
    assert (final.text, final.finish_reason, final.token_ids) == (text, "stop", tuple(script[:n_tokens]))
    assert "".join(out.new_text for out in outs) == text
    engine.close()
