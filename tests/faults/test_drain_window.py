"""Shutdown with requests that outlast the drain: the engine fails them while their handlers
still run, so each client gets a 503 ``engine_unavailable`` (a stream: an error event, then
[DONE]) instead of uvicorn's bare 500 when its own window ends and it cancels the handlers."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from runtime.async_engine import AsyncLLMEngine
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
