"""A flood of long prompts against a tiny KV pool: sequences are preempted (recompute) and
recover; nothing is dropped, every output equals its single-request reference, and the
pool is whole again afterwards."""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx

from runtime.async_engine import AsyncLLMEngine
from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.faults.conftest import engine_config, idle_problems
from tests.server_harness import running_server, wait_until

FLOOD = 6


def test_kv_exhaustion_preempts_and_recovers(tiny_llama_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    # 8 blocks of 8 tokens: prompts of ~22 tokens (3 blocks) are admitted two or three at a
    # time, then each grows to 36-41 tokens (5-6 blocks), so running sequences must be preempted.
    engine = AsyncLLMEngine(engine_config(tiny_llama_dir, num_kv_blocks=8, block_size=8, max_model_len=64))
    preemptions: list[int] = []
    lock = threading.Lock()

    def observe(m) -> None:
        with lock:
            preemptions.append(m.preemptions)

    engine.add_observer(observe)
    try:
        for name in ("a", "b"):
            engine.register_adapter(name, str(tiny_adapters[name]))
        models = [engine.model_name, "a", "b"]
        bodies = [{"model": models[i % 3], "prompt": f"{i:02d} long prompt text, more", "max_tokens": 14 + i, "temperature": 0,
                   "ignore_eos": True, "stream": i % 2 == 1} for i in range(FLOOD)]
        with running_server(create_app(engine, ServerOptions())) as url:

            async def one(client: httpx.AsyncClient, b: dict) -> tuple[int, str]:
                if not b["stream"]:
                    r = await client.post("/v1/completions", json=b)
                    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                parts, status = [], 0
                async with client.stream("POST", "/v1/completions", json=b) as r:
                    status = r.status_code
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            parts.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"])
                return status, "".join(parts)

            async def flood() -> list[tuple[int, str]]:
                async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                    return list(await asyncio.gather(*(one(client, b) for b in bodies)))

            got = asyncio.run(flood())
            assert [s for s, _ in got] == [200] * FLOOD, got
            assert sum(preemptions) > 0  # the pool really ran out
            with httpx.Client(base_url=url, timeout=120) as client:
                want = [client.post("/v1/completions", json=dict(b, stream=False)).json()["choices"][0]["text"] for b in bodies]
            assert [t for _, t in got] == want
            assert all(len(t) > 0 for t in want)
            assert wait_until(lambda: not idle_problems(engine.snapshot(), registered=2)), idle_problems(engine.snapshot())
    finally:
        engine.shutdown()
