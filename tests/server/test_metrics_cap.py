"""/metrics with more adapters than the label cap: the first N to get a request keep series of
their own, the rest share adapter="__other__", and no series ever goes back."""
from __future__ import annotations

import re
import types

import pytest

from runtime.config import ConfigError
from runtime.server.metrics import ServerMetrics
from runtime.server.serve_config import build_settings, normalize_keys

POOL_KEYS = ("loads", "device_loads", "host_evictions", "device_evictions", "retired", "device_hits", "host_hits", "disk_misses")


def _finished(adapter: str | None) -> types.SimpleNamespace:
    return types.SimpleNamespace(adapter=adapter, finish_reason="length", queue_time=0.01, output_tokens=5, prompt_tokens=7,
                                 ttft=0.05, tpot=0.01, adapter_wait=0.0)


def _counters(loads: int, hits: int) -> dict[str, int]:
    return {**dict.fromkeys(POOL_KEYS, 0), "loads": loads, "device_hits": hits}


def _series(text: str, metric: str) -> dict[str, float]:
    """adapter label -> value of ``metric`` (no other labels)."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{metric}{{adapter="([^"]*)"}} (\S+)$', text, re.M)}


def test_adapters_past_the_cap_share_one_label_and_no_series_goes_back() -> None:
    snap: dict = {"adapters": {}}
    metrics = ServerMetrics(lambda: snap, max_adapters=2)
    snap["adapters"] = {"a": _counters(1, 1), "quiet": _counters(1, 0)}
    metrics.observe(_finished("a"))
    text = metrics.render().decode()
    assert _series(text, "lorafleet_adapter_loads_total") == {"a": 1.0}  # quiet has had no request: not shown while the cap is not full
    snap["adapters"].update({"b": _counters(2, 1), "c": _counters(4, 3), "d": _counters(8, 0)})
    for name in ("b", "c", "c", None):
        metrics.observe(_finished(name))
    text = metrics.render().decode()
    # a and b got requests first; c (requests) and quiet, d (none) are counted together, the base model apart
    assert _series(text, "lorafleet_adapter_loads_total") == {"a": 1.0, "b": 2.0, "__other__": 13.0}
    assert _series(text, "lorafleet_adapter_device_hits_total") == {"a": 1.0, "b": 1.0, "__other__": 3.0}
    assert _series(text, "lorafleet_generation_tokens_total") == {"a": 5.0, "b": 5.0, "__other__": 10.0, "__base__": 5.0}
    assert _series(text, "lorafleet_time_to_first_token_seconds_count") == {"a": 1.0, "b": 1.0, "__other__": 2.0, "__base__": 1.0}
    before = _series(text, "lorafleet_adapter_loads_total")
    snap["adapters"].update({"e": _counters(16, 5)})
    snap["adapters"]["a"] = _counters(3, 2)
    after = _series(metrics.render().decode(), "lorafleet_adapter_loads_total")
    assert after == {"a": 3.0, "b": 2.0, "__other__": 29.0}
    assert all(after[k] >= v for k, v in before.items())  # counters only grow


def test_a_thousand_busy_adapters_render_a_bounded_page() -> None:
    snap = {"adapters": {f"a{i}": _counters(1, 2) for i in range(1000)}}
    capped, uncapped = ServerMetrics(lambda: snap, max_adapters=100), ServerMetrics(lambda: snap, max_adapters=1000)
    for i in range(1000):
        capped.observe(_finished(f"a{i}"))
        uncapped.observe(_finished(f"a{i}"))
    capped_lines, all_lines = capped.render().count(b"\n"), uncapped.render().count(b"\n")
    assert len(set(re.findall(r'adapter="([^"]*)"', capped.render().decode()))) == 101  # 100 and __other__
    assert capped_lines * 8 < all_lines  # ~80 lines an adapter: 101 labels against 1000


def test_cap_of_zero_counts_every_adapter_under_other() -> None:
    snap = {"adapters": {"a": _counters(1, 1)}}
    metrics = ServerMetrics(lambda: snap, max_adapters=0)
    metrics.observe(_finished("a"))
    text = metrics.render().decode()
    assert _series(text, "lorafleet_adapter_loads_total") == {"__other__": 1.0}
    assert 'adapter="a"' not in text


def test_the_cap_is_a_serve_setting(tiny_llama_dir) -> None:
    model = {"model": str(tiny_llama_dir)}
    assert build_settings({}, normalize_keys(model, "flags"), None).server.metrics_max_adapters == 100
    assert build_settings(normalize_keys({"metrics-max-adapters": 5}, "file"), normalize_keys(model, "flags"), None).server.metrics_max_adapters == 5
    for bad in (-1, True, "10"):
        with pytest.raises(ConfigError, match="metrics_max_adapters: expected an integer >= 0"):
            build_settings(normalize_keys({"metrics_max_adapters": bad}, "file"), normalize_keys(model, "flags"), None)



def test_thousands_registered_and_none_used_render_nothing_per_adapter() -> None:
    """2000 adapters registered, none requested: no adapter series at all (a soak measured 1 MB
    and 2003 labels per scrape here, while the cap was not yet full)."""
    snap = {"adapters": {f"a{i}": _counters(1, 0) for i in range(2000)}}
    text = ServerMetrics(lambda: snap, max_adapters=100).render().decode()
    assert 'adapter="' not in text


def test_unloaded_adapters_past_the_cap_fold_into_one_engine_entry(tiny_llama_dir, tiny_adapters) -> None:
    """Load, use and unload many distinct names: the engine's per-name counter tables kept an
    entry for every name ever served. Names /metrics already counts under __other__ are folded
    into one engine entry once unregistered, and every exported series reads as it would
    without the fold (counters only grow, totals kept)."""
    from runtime.request import SamplingParams
    from tests.engine_helpers import make_engine

    engine = make_engine(tiny_llama_dir)
    metrics = ServerMetrics(engine.snapshot, max_adapters=1, fold_counters=engine.fold_adapter_counters)
    engine.add_observer(metrics.observe)
    seen: dict[str, float] = {}
    for i in range(6):
        engine.register_adapter(f"n{i}", str(tiny_adapters["a"]))
        engine.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1), f"n{i}")
        while engine.has_unfinished():
            engine.step()
        engine.unregister_adapter(f"n{i}")
        engine.step()  # the unloaded version is retired from the pool
        text = metrics.render().decode()
        loads = _series(text, "lorafleet_adapter_loads_total")
        assert loads == ({"n0": 1.0, "__other__": float(i)} if i else {"n0": 1.0}), loads
        for metric in ("lorafleet_adapter_loads_total", "lorafleet_adapter_versions_retired_total", "lorafleet_adapter_host_hits_total"):
            for label, value in _series(text, metric).items():
                assert value >= seen.get(f"{metric}{label}", 0.0), (metric, label)
                seen[f"{metric}{label}"] = value
    assert _series(text, "lorafleet_adapter_versions_retired_total") == {"n0": 1.0, "__other__": 5.0}
    assert set(engine.pool.counters) <= {"n0", "n5", "__other__"} and set(engine._request_counters) <= {"n0", "n5", "__other__"}
    assert engine.snapshot()["adapters"]["__other__"]["requests"] >= 4  # folded, not dropped
    engine.close()


@pytest.mark.anyio
async def test_the_server_folds_unloaded_adapters_past_the_cap(tiny_llama_dir, tiny_adapters) -> None:
    """The app hands /metrics' fold to its engine: an unloaded adapter counted under __other__
    leaves the engine's per-name tables after a scrape, its counts kept under __other__."""
    from runtime.async_engine import AsyncLLMEngine
    from runtime.server.app import create_app
    from runtime.server.options import ServerOptions
    from tests.server.conftest import client_for, make_engine_config

    engine = AsyncLLMEngine(make_engine_config(tiny_llama_dir))
    try:
        engine.register_adapter("gone", str(tiny_adapters["a"]))
        app = create_app(engine, ServerOptions(metrics_max_adapters=0))
        async with client_for(app) as c:
            r = await c.post("/v1/completions", json={"model": "gone", "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200, r.text
            engine.unregister_adapter("gone")
            first = (await c.get("/metrics")).text
            second = (await c.get("/metrics")).text
        assert "gone" not in engine.snapshot()["adapters"]
        for text in (first, second):
            assert _series(text, "lorafleet_adapter_loads_total") == {"__other__": 1.0}
    finally:
        engine.shutdown()
