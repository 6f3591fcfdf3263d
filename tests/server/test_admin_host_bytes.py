"""An admin load of an adapter larger than the whole host tier (``--max-cpu-lora-bytes``) is a 400
``invalid_adapter`` naming both sizes, and nothing is registered; /metrics shows the bound."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for, make_engine_config

pytestmark = pytest.mark.anyio


async def test_a_too_large_adapter_is_a_400_and_nothing_is_registered(tiny_llama_dir: Path, adapter_root: Path) -> None:
    from runtime.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(make_engine_config(tiny_llama_dir, max_cpu_lora_bytes=1024))
    try:
        app = create_app(engine, ServerOptions(enable_adapter_admin=True, adapter_roots=(adapter_root,)))
        async with client_for(app) as c:
            load = await c.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapter_root / "a")})
            metrics = (await c.get("/metrics")).text
        assert load.status_code == 400, load.text
        error = load.json()["error"]
        assert error["code"] == "invalid_adapter" and "more than the whole host tier may hold" in error["message"]
        assert "1024 bytes" in error["message"] and "\n" not in error["message"]
        assert engine.adapters() == []
        assert "lorafleet_adapter_host_bytes_capacity 1024.0" in metrics and "lorafleet_adapter_host_bytes_in_use 0.0" in metrics
    finally:
        engine.shutdown(timeout=5)
