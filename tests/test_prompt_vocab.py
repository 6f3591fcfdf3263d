"""A tokenizer with added tokens beyond the model's vocab_size: the engine warns at start and
refuses a prompt that encodes to such an id (before, the id reached the model runner and
step() raised, failing every request in flight)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from runtime.request import SamplingParams
from tests.engine_helpers import make_engine, run_to_completion
from tests.fixtures.tiny_models import build_tiny_model

VOCAB = 260  # the byte tokenizer has 259 tokens (256 bytes + <s>, </s>, <pad>)


@pytest.fixture(scope="module")
def oversized_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny llama with vocab_size 260 whose tokenizer adds <|tool|> (id 259) and <|extra|> (id 260)."""
    from tokenizers import Tokenizer as HFTokenizer

    out = build_tiny_model(tmp_path_factory.mktemp("tiny_oversized_tok"), "llama", seed=4, vocab_size=VOCAB)
    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens(["<|tool|>", "<|extra|>"])
    assert tok.token_to_id("<|tool|>") == VOCAB - 1 and tok.token_to_id("<|extra|>") == VOCAB
    tok.save(str(out / "tokenizer.json"))
    return out


def test_engine_warns_at_start_when_tokenizer_exceeds_model_vocab(oversized_tokenizer_dir, tiny_llama_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="runtime.engine"):
        make_engine(oversized_tokenizer_dir)
    warnings = [r.getMessage() for r in caplog.records if "vocab_size" in r.getMessage()]
    assert len(warnings) == 1 and "261 tokens" in warnings[0] and "vocab_size is 260" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runtime.engine"):
        make_engine(tiny_llama_dir)  # 259 tokens, vocab_size 300: fine
    assert not [r for r in caplog.records if "vocab_size" in r.getMessage()]


def test_encoded_prompt_with_out_of_vocab_id_is_refused_and_others_still_run(oversized_tokenizer_dir):
    engine = make_engine(oversized_tokenizer_dir)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("ok", "hi <|tool|>", params)  # id 259 < 260: served
    with pytest.raises(ValueError, match=r"token ids \[260\].*tokenizer and model disagree"):
        engine.add_request("bad", "hi <|extra|>", params)
    with pytest.raises(ValueError, match=r"token ids \[260\]"):
        engine.add_request("bad-ids", [256, 104, 260], params)
    finals = run_to_completion(engine)
    assert set(finals) == {"ok"}
    assert finals["ok"].finish_reason == "length" and len(finals["ok"].token_ids) == 4
