"""Shutdown with requests that outlast the drain: the engine fails them while their handlers
still run, so each client gets a 503 ``engine_unavailable`` (a stream: an error event, then
[DONE]) instead of uvicorn's bare 500 when its own window ends and it cancels the handlers."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from runtime.async_engine import AsyncLLMEngine
from runtime.commands.serve import ENGINE_DRAIN_S, GRACEFUL_SHUTDOWN_S
from runtime.server.app import create_app
from runtime.server.draining_server import DrainingServer
from tests.faults.conftest import engine_config
from tests.server_harness import free_port

PLAIN = 8


def test_requests_left_when_the_drain_ends_get_a_503_and_a_clean_stream_end(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine(engine_config(tiny_llama_dir, max_num_seqs=1, max_model_len=256, num_kv_blocks=128))
    port = free_port()
    config = uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=20)
    server = DrainingServer(config, engine, drain_s=0.5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hello", "max_tokens": 250, "ignore_eos": True}  # one at a time: seconds of work in all
    results: dict[str, object] = {}

    def plain(i: int) -> None:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        results[f"plain{i}"] = (r.status_code, r.json())

    def stream(i: int) -> None:
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        results[f"stream{i}"] = events

    def wait_for(accepted: int) -> None:
        """Until the engine has taken ``accepted`` requests (waiting, running or answered). Counting
        waiting alone cannot tell the last stream apart from a plain request that finished early:
        shutting down with that stream still in flight resets its connection (no handler yet)."""
        deadline = time.monotonic() + 20
        while True:
            # Answered first, then one snapshot: a request that finishes in between is counted
            # nowhere (the wait only goes on), never twice; one moving from waiting to running, once.
            answered = len(results)
            snap = engine.snapshot()
            taken = snap["waiting"] + snap["running"] + answered
            if taken >= accepted:
                return
            assert time.monotonic() < deadline, taken
            time.sleep(0.01)

    clients = [threading.Thread(target=plain, args=(i,)) for i in range(PLAIN)]
    for c in clients:
        c.start()
    wait_for(PLAIN)
    clients += [threading.Thread(target=stream, args=(i,)) for i in range(2)]  # at the back of the queue
    for c in clients[PLAIN:]:
        c.start()
    wait_for(PLAIN + 2)
    started = time.monotonic()
    server.should_exit = True
    for c in clients:
        c.join(30)
    thread.join(30)
    assert server.drain is not None
    server.drain.join(30)
    assert time.monotonic() - started < 15  # the drain's 0.5 s, not uvicorn's 20 s window
    plain_results = [results[f"plain{i}"] for i in range(PLAIN)]
    assert any(status == 503 for status, _ in plain_results), plain_results
    for status, reply in plain_results:
        assert status in (200, 503), (status, reply)
        if status == 503:
            assert reply["error"]["code"] == "engine_unavailable" and "shut down" in reply["error"]["message"]
    streams = [results[f"stream{i}"] for i in range(2)]
    assert all(events[-1] == "[DONE]" for events in streams), [events[-2:] for events in streams]
    errors = [json.loads(e)["error"] for events in streams for e in events[:-1] if "error" in json.loads(e)]
    assert errors and all(e["code"] == "engine_unavailable" for e in errors), [events[-2:] for events in streams]
    assert not engine.running


class _Stop(Exception):
    """Ends ``DrainingServer.shutdown`` once the engine was asked to shut down (no server to stop)."""


class _RecordingEngine:
    def shutdown_in_background(self, timeout: float, step_grace_s: float) -> None:
        self.asked = (timeout, step_grace_s)
        raise _Stop


def test_the_drain_and_a_stuck_step_s_grace_must_both_end_inside_uvicorn_s_window() -> None:
    """Only drain_s was checked against uvicorn's window, but a step still running when it ends
    gets step_grace_s more: drain_s=28 of a 30 s window passed, and a stuck step then left the
    requests in flight to uvicorn's bare 500s. A window of 0 (none at all) passed any drain_s."""
    def config(window: float | None) -> uvicorn.Config:
        return uvicorn.Config("app:app", timeout_graceful_shutdown=window)

    with pytest.raises(ValueError, match=r"drain_s \+ step_grace_s \(28\.0 \+ 3\.0 s\) must end inside uvicorn's graceful shutdown window \(30 s\)"):
        DrainingServer(config(30), _RecordingEngine(), drain_s=28.0)  # inside the window alone, not with the default grace
    for window, drain_s, grace in [(30, 20.0, 10.0), (0, 0.5, 0.0)]:
        with pytest.raises(ValueError, match="must end inside"):
            DrainingServer(config(window), _RecordingEngine(), drain_s=drain_s, step_grace_s=grace)
    DrainingServer(config(GRACEFUL_SHUTDOWN_S), _RecordingEngine(), drain_s=ENGINE_DRAIN_S)  # lorafleet serve's own
    DrainingServer(config(None), _RecordingEngine(), drain_s=1000.0)  # no window: uvicorn waits for every connection
    engine = _RecordingEngine()
    with pytest.raises(_Stop):
        asyncio.run(DrainingServer(config(30), engine, drain_s=5.0, step_grace_s=2.0).shutdown())
    assert engine.asked == (5.0, 2.0)  # the grace checked is the grace the engine gets


def test_a_negative_or_nan_drain_or_grace_is_refused_before_anything_begins() -> None:
    """check_shutdown_timeouts (the Ray application's ``drain``, the ingress's ``begin_shutdown``)
    took a negative drain_s (``begin_shutdown(-5)`` told the replicas to drain for -5 s: no drain at
    all, said nowhere), and DrainingServer took a negative or NaN drain_s or grace (NaN passes every
    comparison with the window; the engine's shutdown then never gave up on a stuck step). Each now
    refuses it with a ValueError that names it, before the engine is told anything."""
    from runtime.distributed.shutdown_timeouts import check_shutdown_timeouts

    window = uvicorn.Config("app:app", timeout_graceful_shutdown=30)
    for bad in (-5.0, float("nan")):
        with pytest.raises(ValueError, match=r"drain_s must be a number of seconds >= 0, got (-5\.0|nan)"):
            check_shutdown_timeouts(bad)
        with pytest.raises(ValueError, match=r"step_grace_s must be a number of seconds >= 0"):
            check_shutdown_timeouts(1.0, step_grace_s=bad)
        engine = _RecordingEngine()
        with pytest.raises(ValueError, match=r"drain_s must be a number of seconds >= 0"):
            DrainingServer(window, engine, drain_s=bad)
        with pytest.raises(ValueError, match=r"step_grace_s must be a number of seconds >= 0"):
            DrainingServer(window, engine, drain_s=1.0, step_grace_s=bad)
        assert not hasattr(engine, "asked")
    check_shutdown_timeouts(0.0)  # no drain at all, said so
    DrainingServer(window, _RecordingEngine(), drain_s=0.0, step_grace_s=0.0)
