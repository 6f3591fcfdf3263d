"""runtime.bench.suite.prepare builds only the adapters the requests use, with stable seeds."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from runtime.bench.suite import BenchSetup, prepare
from runtime.bench.synthetic import LlamaShape
from runtime.bench.workload import WorkloadSpec, generate


def test_only_used_adapters_are_built_and_each_is_the_same_whoever_uses_it(tmp_path: Path):
    setup = BenchSetup(workdir=tmp_path, shape=LlamaShape.sized(64, 1))
    spec = WorkloadSpec(num_requests=6, num_adapters=200, popularity="zipf", alpha=1.0, ranks=(4, 8), seed=3)
    workload = generate(spec)
    used = {r.adapter for r in workload.requests if r.adapter}
    assert 0 < len(used) < 200
    model_dir, adapters = prepare(workload, setup)
    assert set(adapters) == used
    assert len(list((tmp_path / "adapters").iterdir())) == len(used)
    # A workload over the same adapters with other requests: shared adapters are the same folders and bytes.
    other = generate(dataclasses.replace(spec, num_requests=12, seed=3))
    _, more = prepare(other, setup)
    assert used & set(more), "the two workloads share no adapter: pick other seeds"
    for name in used & set(more):
        assert more[name] == adapters[name]
    fresh = BenchSetup(workdir=tmp_path / "fresh", shape=setup.shape)
    _, rebuilt = prepare(other, fresh)
    for name in used & set(rebuilt):
        assert (rebuilt[name] / "adapter_model.safetensors").read_bytes() == (adapters[name] / "adapter_model.safetensors").read_bytes()
