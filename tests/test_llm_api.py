"""Offline API: LLM(...).generate over the continuous-batching engine."""
from __future__ import annotations

import subprocess
import sys

import pytest

from runtime import LLM, SamplingParams


def test_generate_mixed_adapters_matches_single_prompt_calls(tiny_llama_dir, tiny_adapters):
    llm = LLM(str(tiny_llama_dir), adapters={n: str(p) for n, p in tiny_adapters.items()}, max_lora_rank=16, max_loras=2, num_kv_blocks=64, block_size=4)
    prompts = ["hello", "the cat", [5, 6, 7, 8], "xyz"]
    adapters = ["a", None, "c", "e"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    batch = llm.generate(prompts, params, adapter=adapters)
    single = [llm.generate([p], params, adapter=a)[0] for p, a in zip(prompts, adapters)]
    assert [r.token_ids for r in batch] == [r.token_ids for r in single]
    assert [r.adapter for r in batch] == adapters and all(r.finish_reason == "length" for r in batch)
    assert batch[0].text == llm.tokenizer.decode(batch[0].token_ids)


def test_generate_validates_arguments(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="adapter: got 1 values for 2 prompts"):
        llm.generate(["a", "b"], adapter=[None])
    with pytest.raises(ValueError, match=r"prompts\[1\].*not registered"):
        llm.generate(["a", "b"], adapter=[None, "missing"])
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="unknown config key"):
        LLM(str(tiny_llama_dir), not_a_key=1)


def test_import_runtime_is_light():
    code = "import sys, runtime; assert 'torch' not in sys.modules; from runtime import LLM, SamplingParams; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "ok"
