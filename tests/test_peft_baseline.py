"""runtime/bench/peft_baseline.py: the warm-up it gets before its timed run (one 2-token batch, or
with ``full_warmup`` the whole run, as the engine gets off the CPU), and what the timed run counts."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")

from peft import PeftModelForCausalLM  # noqa: E402

from runtime.bench.peft_baseline import run_peft  # noqa: E402
from runtime.bench.synthetic import LlamaShape, build_random_adapters, build_random_llama  # noqa: E402
from runtime.bench.workload import WorkloadSpec, generate  # noqa: E402

SHAPE = LlamaShape.sized(64, 1)


@pytest.mark.parametrize("full_warmup, dtype", [(False, "float32"), (True, "bfloat16")])
def test_warm_up_then_every_batch_once_timed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_warmup: bool, dtype: str) -> None:
    """Each generate call gets its rows' own adapters (``adapter_names``, the base model as
    ``__base__``) on a model in the asked dtype."""
    import torch

    workload = generate(WorkloadSpec(num_requests=6, num_adapters=2, popularity="uniform", input_len=(2, 4), output_len=(2, 5), rate=0.0, seed=4,
                                     base_fraction=0.34))  # fmt: skip
    model = build_random_llama(tmp_path / "m", SHAPE)
    adapters = build_random_adapters(tmp_path / "a", SHAPE, workload.adapter_ranks)
    calls: list[tuple[int, int, list[str], torch.dtype]] = []  # (rows, new tokens, adapter names, dtype) of each generate call, in order
    real = PeftModelForCausalLM.generate  # PEFT's own generate: it takes adapter_names off before transformers sees them

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((int(kwargs["input_ids"].shape[0]), int(kwargs["max_new_tokens"]), kwargs.get("adapter_names"), self.dtype))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PeftModelForCausalLM, "generate", spy)
    result = run_peft(model, adapters, workload.requests, batch_size=2, full_warmup=full_warmup, dtype=dtype)
    ordered = sorted(workload.requests, key=lambda r: r.arrival_s)
    assert {r.adapter for r in ordered} >= {None, "lora-0000", "lora-0001"}, "the workload mixes adapters and the base model"
    batches = [ordered[i : i + 2] for i in range(0, 6, 2)]
    want_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    timed = [(len(b), max(r.output_tokens for r in b), [r.adapter or "__base__" for r in b], want_dtype) for b in batches]
    warm = timed if full_warmup else [(2, 2, timed[0][2], want_dtype)]
    assert calls == warm + timed
    assert sum(r.output_tokens for r in result.records) == sum(r.output_tokens for r in workload.requests)
