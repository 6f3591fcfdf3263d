"""Server fixtures: one real engine on the tiny llama with three adapters, shared per module."""
from __future__ import annotations

import asyncio
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from runtime.config import EngineConfig



@pytest.fixture
def anyio_backend() -> str:
    """The async tests (``pytest.mark.anyio``) run on asyncio."""
    return "asyncio"


@pytest.fixture
async def small_default_executor() -> AsyncIterator[int]:
    """The event loop's default executor (``asyncio.to_thread``'s) with 2 threads, as on a small
    machine, whatever this one's core count."""
    loop = asyncio.get_running_loop()
    small = ThreadPoolExecutor(max_workers=2)
    loop.set_default_executor(small)
    try:
        yield 2
    finally:
        loop.set_default_executor(ThreadPoolExecutor())
        small.shutdown(wait=False)


def client_for(app, raise_app_exceptions: bool = True) -> httpx.AsyncClient:
    """An httpx client that calls the ASGI app in-process."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60)


async def post_ok(c: httpx.AsyncClient, route: str, body: dict) -> dict:
    """POST ``body``; the reply must be a 200, whose JSON is returned."""
    r = await c.post(route, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def sse_chunks(c: httpx.AsyncClient, route: str, body: dict) -> list[dict]:
    """POST ``body`` with ``stream: true``; the JSON of every ``data:`` event before ``[DONE]``."""
    chunks = []
    async with c.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def make_engine_config(model_dir: Path, **overrides) -> EngineConfig:
    values = dict(model=str(model_dir), device="cpu", dtype="float32", max_loras=4, max_lora_rank=32,
                  max_cpu_loras=8, max_num_seqs=16, max_model_len=96, block_size=8, num_kv_blocks=128)
    values.update(overrides)
    return EngineConfig(**values)


@pytest.fixture(scope="module")
def adapter_root(tiny_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Copies of the test adapters inside one folder, to act as --adapter-root."""
    root = tmp_path_factory.mktemp("adapter_root")
    for name, path in tiny_adapters.items():
        shutil.copytree(path, root / name)
    return root


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, tiny_adapters: dict[str, Path]):
    from runtime.async_engine import AsyncLLMEngine

    eng = AsyncLLMEngine(make_engine_config(tiny_llama_dir))
    names = sorted(tiny_adapters)[:3]
    for name in names:
        eng.register_adapter(name, str(tiny_adapters[name]))
    yield eng
    eng.shutdown()
