"""An engine whose host tier is bounded by bytes (``max_cpu_lora_bytes``): requests for adapters
that do not fit together all finish, the bound holds, /metrics shows it, and an adapter larger
than the whole bound is refused at registration with both sizes."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.lora.pool import AdapterTooLarge
from runtime.request import SamplingParams
from runtime.server.metrics import ServerMetrics
from tests.engine_helpers import make_engine, run_to_completion


@pytest.fixture(scope="module")
def sizes(tiny_llama_dir: Path, tiny_adapters: dict[str, Path]) -> dict[str, int]:
    engine = make_engine(tiny_llama_dir)
    try:
        return {name: engine.load_adapter_files(name, str(tiny_adapters[name])).nbytes for name in ("a", "b", "c")}
    finally:
        engine.close()


def test_adapters_that_do_not_fit_together_take_turns(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], sizes: dict[str, int]) -> None:
    bound = max(sizes["a"], sizes["b"])
    assert sizes["a"] + sizes["b"] > bound  # one at a time
    engine = make_engine(tiny_llama_dir, max_cpu_loras=None, max_cpu_lora_bytes=bound)
    try:
        for name in ("a", "b"):
            engine.register_adapter(name, str(tiny_adapters[name]))
        for i in range(6):
            engine.add_request(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True), "ab"[i % 2])
        finals = run_to_completion(engine)
        assert sorted(finals) == [f"r{i}" for i in range(6)] and all(o.error is None for o in finals.values())
        snap = engine.snapshot()
        assert 0 < snap["host_bytes_in_use"] <= bound and snap["host_bytes_capacity"] == bound
        assert snap["adapters"]["a"]["host_evictions"] + snap["adapters"]["b"]["host_evictions"] > 0
        text = ServerMetrics(engine.snapshot).render().decode()
        assert f"lorafleet_adapter_host_bytes_capacity {float(bound)}" in text
        assert f"lorafleet_adapter_host_bytes_in_use {float(snap['host_bytes_in_use'])}" in text
    finally:
        engine.close()


def test_without_a_byte_bound_the_capacity_is_infinite(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], sizes: dict[str, int]) -> None:
    engine = make_engine(tiny_llama_dir)
    try:
        engine.register_adapter("a", str(tiny_adapters["a"]))
        snap = engine.snapshot()
        assert (snap["host_bytes_in_use"], snap["host_bytes_capacity"]) == (sizes["a"], None)
        assert "lorafleet_adapter_host_bytes_capacity +Inf" in ServerMetrics(engine.snapshot).render().decode()
    finally:
        engine.close()


def test_an_adapter_larger_than_the_bound_is_refused_at_registration(tiny_llama_dir: Path, tiny_adapters: dict[str, Path],
                                                                     sizes: dict[str, int]) -> None:
    bound = sizes["c"] - 1
    engine = make_engine(tiny_llama_dir, max_cpu_lora_bytes=bound)
    try:
        with pytest.raises(AdapterTooLarge) as err:
            engine.register_adapter("c", str(tiny_adapters["c"]))
        message = str(err.value)
        assert f"({sizes['c']} bytes)" in message and f"{bound} bytes" in message and "--max-cpu-lora-bytes" in message
        assert engine.adapters() == [] and engine.snapshot()["host_bytes_in_use"] == 0  # nothing registered
        unbounded = make_engine(tiny_llama_dir)
        try:
            adapter = unbounded.load_adapter_files("c", str(tiny_adapters["c"]))  # read where no bound applies
        finally:
            unbounded.close()
        with pytest.raises(AdapterTooLarge):  # install_adapter checks too: a caller may read elsewhere
            engine.install_adapter(adapter, str(tiny_adapters["c"]))
        assert engine.adapters() == []
    finally:
        engine.close()
