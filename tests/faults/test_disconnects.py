"""Clients that go away at random points: mid-stream, or a non-streaming request that times
out while queued, in prefill or in decode. The server ends idle; the requests that did
complete are exactly their single-request references."""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx

from runtime.async_engine import AsyncLLMEngine
from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.faults.conftest import engine_config, idle_problems
from tests.server_harness import running_server, wait_until

CLIENTS = 24


async def one_client(url: str, k: int, rng: random.Random, model: str) -> tuple[str, str, str | None]:
    """Returns (behaviour, prompt, text if it completed)."""
    prompt = f"client {k} asks about item {rng.randint(0, 999)}"
    body = {"model": model, "prompt": prompt, "max_tokens": rng.choice((8, 24, 48)), "temperature": 0, "ignore_eos": True}
    behaviour = rng.choice(("complete", "drop-stream", "timeout"))
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        if behaviour == "complete":
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return behaviour, body, r.json()["choices"][0]["text"]
        if behaviour == "drop-stream":
            keep = rng.randint(1, 6)  # SSE events to read before hanging up
            async with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
                got = 0
                async for line in r.aiter_lines():
                    got += bool(line)
                    if got >= keep:
                        break
            return (behaviour if got >= keep else "stream-ended"), body, None
        try:
            await asyncio.wait_for(client.post("/v1/completions", json=body), rng.uniform(0.01, 1.5))
        except asyncio.TimeoutError:
            return behaviour, body, None
        return "complete", body, None  # fast enough: finished before the timeout


def test_random_disconnects_and_timeouts_leave_server_idle(tiny_llama_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    engine = AsyncLLMEngine(engine_config(tiny_llama_dir, max_loras=2, max_cpu_loras=4))
    try:
        for name in ("a", "b", "c"):
            engine.register_adapter(name, str(tiny_adapters[name]))
        finished: list = []
        engine.add_observer(finished.append)
        # 20 ms a step: a 48-token request takes about a second, so its client's hang-up comes before its end.
        runner = engine.engine.runner
        real_execute = runner.execute
        runner.execute = lambda steps: (time.sleep(0.02), real_execute(steps))[1]
        models = [engine.model_name, "a", "b", "c"]
        with running_server(create_app(engine, ServerOptions())) as url:
            async def crowd():
                return await asyncio.gather(*(one_client(url, k, random.Random(k), models[k % 4]) for k in range(CLIENTS)))

            results = asyncio.run(crowd())
            assert {b for b, _, _ in results} >= {"drop-stream", "timeout"}
            assert wait_until(lambda: not idle_problems(engine.snapshot(), registered=3), timeout_s=30), idle_problems(engine.snapshot())
            runner.execute = real_execute
            # Each completed request ran to its end; each client that hung up on a 48-token stream after at most 6
            # events left a request that the server aborted. (A timed-out client may have gone before its request
            # reached the server, so those are not counted.)
            completed = sum(b == "complete" for b, _, _ in results)
            hung_up = sum(b == "drop-stream" and body["max_tokens"] == 48 for b, body, _ in results)
            assert hung_up >= 1, results
            reasons = lambda: [m.finish_reason for m in finished]  # noqa: E731
            assert wait_until(lambda: reasons().count("length") >= completed and reasons().count("abort") >= hung_up), (reasons(), results)
            assert set(reasons()) <= {"length", "abort"} and len(finished) <= CLIENTS, reasons()
            # Completed requests are unaffected by their neighbours' disconnects.
            with httpx.Client(base_url=url, timeout=60) as client:
                for _, body, text in results:
                    if text is not None:
                        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == text
                assert client.get("/health").status_code == 200
            assert idle_problems(engine.snapshot(), registered=3) == []
    finally:
        engine.shutdown()
