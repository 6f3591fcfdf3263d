"""A dead or shutting-down engine is visible: /health and new requests answer 503 in the OpenAI
shape, and no route ever answers in plain text (in-process, httpx over ASGI)."""
from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for, make_engine_config
from tests.server_harness import wait_until

pytestmark = pytest.mark.anyio


def completion(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0}


def assert_unavailable(r: httpx.Response, fragment: str) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and err["code"] == "engine_unavailable"
    assert fragment in err["message"]


@pytest.fixture
def fresh_engine(tiny_llama_dir: Path):
    """An engine of its own: these tests kill it."""
    from runtime.async_engine import AsyncLLMEngine

    eng = AsyncLLMEngine(make_engine_config(tiny_llama_dir))
    yield eng
    eng.shutdown(timeout=5)


async def test_dead_engine_fails_health_and_new_requests_with_503(fresh_engine) -> None:
    def broken_step(**_: Any) -> list:
        raise RuntimeError("simulated device fault")

    fresh_engine.engine.step = broken_step  # the step thread's next step raises
    app = create_app(fresh_engine, ServerOptions())
    async with client_for(app) as c:
        assert (await c.get("/health")).json() == {"status": "ok"}
        failed = await c.post("/v1/completions", json=completion(fresh_engine.model_name))  # the request that kills the step
        assert failed.status_code == 500 and "simulated device fault" in failed.json()["error"]["message"]
        assert fresh_engine.dead_error is not None
        assert_unavailable(await c.get("/health"), "simulated device fault")
        assert_unavailable(await c.post("/v1/completions", json=completion(fresh_engine.model_name)), "simulated device fault")
        chat = {"model": fresh_engine.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert_unavailable(await c.post("/v1/chat/completions", json=chat), "simulated device fault")


async def test_dead_engine_refuses_adapter_loads_and_unloads_with_503(fresh_engine, adapter_root: Path) -> None:
    """Once a step failed, the admin routes answered as if the engine were alive: a load read the
    files and installed them into the dead engine, a 200 "loaded" for an adapter no request can
    use, and an unload a 200 too, where the generation routes (and admin.py's docstring, and the
    error table) say 503 engine_unavailable. Now both are that 503, and nothing changes."""
    fresh_engine.register_adapter("kept", str(adapter_root / "a"))

    def broken_step(**_: Any) -> list:
        raise RuntimeError("simulated device fault")

    fresh_engine.engine.step = broken_step
    app = create_app(fresh_engine, ServerOptions(enable_adapter_admin=True, adapter_roots=(adapter_root,)))
    async with client_for(app) as c:
        failed = await c.post("/v1/completions", json=completion(fresh_engine.model_name))  # the request that kills the step
        assert failed.status_code == 500 and fresh_engine.dead_error is not None
        load = await c.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapter_root / "b")})
        unload = await c.post("/v1/unload_lora_adapter", json={"lora_name": "kept"})
    assert_unavailable(load, "simulated device fault")
    assert_unavailable(unload, "simulated device fault")
    assert [a.name for a in fresh_engine.adapters()] == ["kept"]


async def test_shutting_down_engine_fails_health_and_new_requests_with_503(fresh_engine) -> None:
    """While shutdown() waits for the requests in flight, the engine refuses new ones: so does /health."""
    step, gate = fresh_engine.engine.step, threading.Event()
    fresh_engine.engine.step = lambda **kw: step(**kw) if gate.is_set() else []  # nothing finishes until the gate opens
    app = create_app(fresh_engine, ServerOptions())
    async with client_for(app) as c:
        in_flight = asyncio.create_task(c.post("/v1/completions", json=completion(fresh_engine.model_name)))
        assert await asyncio.to_thread(wait_until, lambda: fresh_engine.engine.has_unfinished(), 10)
        stopper = threading.Thread(target=fresh_engine.shutdown, kwargs={"timeout": 30})
        stopper.start()
        try:
            assert await asyncio.to_thread(wait_until, lambda: not fresh_engine.accepting, 10)
            assert fresh_engine.dead_error is None  # still draining
            assert_unavailable(await c.get("/health"), "shutting down")
            assert_unavailable(await c.post("/v1/completions", json=completion(fresh_engine.model_name)), "shutting down")
        finally:
            gate.set()
            await asyncio.to_thread(stopper.join, 30)
        assert (await in_flight).status_code == 200  # the request in flight was drained, not dropped
        assert_unavailable(await c.get("/health"), "shut down")


class _BrokenModels:
    """The shared engine, but listing its adapters raises (a bug no handler anticipates)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def adapters(self) -> list:
        raise KeyError("simulated bug")


async def test_unexpected_errors_are_openai_shaped_500s(engine, caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(_BrokenModels(engine), ServerOptions())
    with caplog.at_level(logging.ERROR, logger="lorafleet.server"):
        async with client_for(app, raise_app_exceptions=False) as c:
            r = await c.get("/v1/models")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["type"] == "internal_server_error" and err["code"] == "internal_error" and "KeyError" in err["message"]
    logged = [rec for rec in caplog.records if "/v1/models" in rec.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback is in the log


async def test_routes_after_shutdown_abandoned_a_stuck_step_answer_503_without_a_traceback(tiny_llama_dir: Path, adapter_root: Path,
                                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Once shutdown gave up on a stuck step (a hung device), the engine lock refuses everyone with
    EngineDeadError: /metrics, whose snapshot takes that lock, answered a 500 and logged an ERROR
    traceback. Now every route that needs the engine answers the 503 ``engine_unavailable`` of a
    shut-down engine (the request in flight too), with no ERROR logged; /v1/models needs no lock."""
    from runtime.async_engine import AsyncLLMEngine
    from tests.engine_helpers import StuckStepEngine

    inner = StuckStepEngine(make_engine_config(tiny_llama_dir))
    engine = AsyncLLMEngine(None, engine=inner)
    app = create_app(engine, ServerOptions(enable_adapter_admin=True, adapter_roots=(adapter_root,)))
    adapter = sorted(p.name for p in adapter_root.iterdir())[0]
    try:
        with caplog.at_level(logging.ERROR, logger="lorafleet"):
            async with client_for(app) as c:
                in_flight = asyncio.create_task(c.post("/v1/completions", json=completion(engine.model_name)))
                assert await asyncio.to_thread(inner.entered.wait, 30)
                await asyncio.to_thread(engine.shutdown, 0.05, 0.05)
                assert engine.step_abandoned
                assert_unavailable(await in_flight, "a step was still running")
                assert_unavailable(await c.get("/metrics"), "shut down while a step was still running")
                assert_unavailable(await c.get("/health"), "shut down while a step was still running")
                assert_unavailable(await c.post("/v1/completions", json=completion(engine.model_name)), "shut down")
                assert_unavailable(await c.post("/v1/load_lora_adapter", json={"lora_name": adapter, "lora_path": str(adapter_root / adapter)}),
                                   "shut down")
                assert_unavailable(await c.post("/v1/unload_lora_adapter", json={"lora_name": adapter}), "shut down")
                assert (await c.get("/v1/models")).status_code == 200
        assert [r.name for r in caplog.records] == ["runtime.async_engine"], caplog.text  # shutdown's own line, nothing from the routes
    finally:
        inner.unstuck.set()  # the step returns: the step thread stops before another
        engine._thread.join(30)
        inner.close()
