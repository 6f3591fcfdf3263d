"""Adapter files that change under the server, and adapters replaced or unloaded mid-request.

* An adapter whose weights file disappears, or is corrupted, after registration and
  before first use: that request gets a clear error naming the file; the requests to
  other adapters and the base are unaffected; restoring the file makes it serve again.
* A hot update and an unload while requests for that adapter run: every in-flight
  request finishes on the version it started with; afterwards the name is gone and the
  retired versions are freed from the pool.
"""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest

from runtime.async_engine import AsyncLLMEngine
from runtime.lora.adapter import WEIGHTS_FILE
from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.faults.conftest import engine_config, idle_problems
from tests.server_harness import running_server, wait_until


def body(model: str, prompt: str, max_tokens: int = 10, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return list(await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies)))


def stream_error(url: str, b: dict) -> str:
    """The error event of a streamed request (and check the stream still ends with [DONE])."""
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=dict(b, stream=True)) as r:
            lines = [l for l in r.iter_lines() if l]
    assert lines[-1] == "data: [DONE]"
    errors = [l for l in lines if '"error"' in l]
    assert errors, lines
    return errors[0]


@pytest.mark.parametrize("fault", ["deleted", "truncated", "bytes-flipped"])
def test_adapter_file_broken_after_registration(fault: str, tiny_llama_dir: Path, adapter_copies: dict[str, Path], tmp_path: Path) -> None:
    # Host tier of 2: registering b and c after a pushes a out, so a's first use reads the disk.
    engine = AsyncLLMEngine(engine_config(tiny_llama_dir, max_loras=2, max_cpu_loras=2))
    try:
        for name in ("a", "b", "c"):
            engine.register_adapter(name, str(adapter_copies[name]))
        weights = adapter_copies["a"] / WEIGHTS_FILE
        good = weights.read_bytes()
        base = engine.model_name
        with running_server(create_app(engine, ServerOptions())) as url:
            others = [body(base, "base prompt"), body("b", "prompt for b"), body("c", "prompt for c")]
            want = [r.json()["choices"][0]["text"] for r in asyncio.run(post_all(url, others))]
            assert all(r.name != "a" for r in engine.engine.pool.host_refs())  # a lives on disk only
            if fault == "deleted":
                weights.unlink()
            elif fault == "truncated":
                weights.write_bytes(good[: len(good) // 2])
            else:  # same size, different tensor bytes: the content no longer matches the registered version
                weights.write_bytes(good[:-64] + bytes(b ^ 0x5A for b in good[-64:]))
            responses = asyncio.run(post_all(url, [body("a", "prompt for a"), *others]))
            bad, rest = responses[0], responses[1:]
            assert bad.status_code == 500, bad.text
            message = bad.json()["error"]["message"]
            assert str(adapter_copies["a"]) in message and "'a'" in message  # names the adapter and its folder/file
            assert [r.status_code for r in rest] == [200, 200, 200]
            assert [r.json()["choices"][0]["text"] for r in rest] == want
            assert str(adapter_copies["a"]) in stream_error(url, body("a", "streamed prompt for a"))
            assert wait_until(lambda: not idle_problems(engine.snapshot(), registered=3)), idle_problems(engine.snapshot())
            # The registration still stands; with the file back, a serves again.
            weights.write_bytes(good)
            again = asyncio.run(post_all(url, [body("a", "prompt for a")]))[0]
            assert again.status_code == 200, again.text
            assert wait_until(lambda: not idle_problems(engine.snapshot(), registered=3)), idle_problems(engine.snapshot())
    finally:
        engine.shutdown()


def test_hot_update_and_unload_during_requests(tiny_llama_dir: Path, adapter_copies: dict[str, Path], tmp_path: Path) -> None:
    root = tmp_path / "root"
    v1, v2 = shutil.copytree(adapter_copies["b"], root / "v1"), shutil.copytree(adapter_copies["d"], root / "v2")
    engine = AsyncLLMEngine(engine_config(tiny_llama_dir, max_loras=2, max_cpu_loras=4))
    try:
        engine.register_adapter("other", str(adapter_copies["a"]))
        options = ServerOptions(enable_adapter_admin=True, adapter_roots=(root,))
        with running_server(create_app(engine, options)) as url, httpx.Client(base_url=url, timeout=60) as admin:
            assert admin.post("/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": str(v1)}).status_code == 200
            prompts = [f"in flight {i}" for i in range(8)]
            want_v1 = [admin.post("/v1/completions", json=body("hot", p, 40)).json()["choices"][0]["text"] for p in prompts]

            async def run() -> list[str]:
                started = asyncio.Event()
                count = 0

                async def stream(p: str) -> str:
                    nonlocal count
                    parts = []
                    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                        async with client.stream("POST", "/v1/completions", json=body("hot", p, 40, stream=True)) as r:
                            async for line in r.aiter_lines():
                                if line.startswith("data: {"):
                                    data = json.loads(line[6:])
                                    assert "error" not in data, data
                                    parts.append(data["choices"][0]["text"])
                                    if len(parts) == 1:
                                        count += 1
                                        if count == len(prompts):
                                            started.set()
                    return "".join(parts)

                async def swap() -> None:
                    await asyncio.wait_for(started.wait(), 30)
                    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": str(v2)})
                        assert r.status_code == 200, r.text
                        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "hot"})
                        assert r.status_code == 200, r.text

                *texts, _ = await asyncio.gather(*(stream(p) for p in prompts), swap())
                return texts

            assert asyncio.run(run()) == want_v1  # every in-flight request finished on v1
            assert admin.post("/v1/completions", json=body("hot", "after unload")).status_code == 404
            assert [m["id"] for m in admin.get("/v1/models").json()["data"]] == [engine.model_name, "other"]
            assert wait_until(lambda: not idle_problems(engine.snapshot(), registered=1)), idle_problems(engine.snapshot(), registered=1)
            assert {r.name for r in engine.engine.pool.host_refs()} == {"other"}
            assert {e[0].name for e in engine.engine.pool.device_residents().values()} <= {"other"}
    finally:
        engine.shutdown()
