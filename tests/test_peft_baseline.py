"""runtime/bench/peft_baseline.py: the warm-up it gets before its timed run (one 2-token batch, or
with ``full_warmup`` the whole run, as the engine gets off the CPU), and what the timed run counts."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")

from transformers.generation.utils import GenerationMixin  # noqa: E402

from runtime.bench.peft_baseline import run_peft  # noqa: E402
from runtime.bench.synthetic import LlamaShape, build_random_adapters, build_random_llama  # noqa: E402
from runtime.bench.workload import WorkloadSpec, generate  # noqa: E402

SHAPE = LlamaShape.sized(64, 1)


@pytest.mark.parametrize("full_warmup", [False, True])
def test_warm_up_then_every_batch_once_timed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_warmup: bool) -> None:
    workload = generate(WorkloadSpec(num_requests=5, num_adapters=2, popularity="uniform", input_len=(2, 4), output_len=(2, 5), rate=0.0, seed=4))
    model = build_random_llama(tmp_path / "m", SHAPE)
    adapters = build_random_adapters(tmp_path / "a", SHAPE, workload.adapter_ranks)
    calls: list[tuple[int, int]] = []  # (rows, new tokens) of each generate call, in order
    real = GenerationMixin.generate

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((int(kwargs["input_ids"].shape[0]), int(kwargs["max_new_tokens"])))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    result = run_peft(model, adapters, workload.requests, batch_size=2, full_warmup=full_warmup)
    ordered = sorted(workload.requests, key=lambda r: r.arrival_s)
    batches = [ordered[i : i + 2] for i in range(0, 5, 2)]
    timed = [(len(b), max(r.output_tokens for r in b)) for b in batches]
    warm = timed if full_warmup else [(2, 2)]
    assert calls == warm + timed
    assert sum(r.output_tokens for r in result.records) == sum(r.output_tokens for r in workload.requests)
