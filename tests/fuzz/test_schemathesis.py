"""Schemathesis against the served /openapi.json: no 5xx, then healthy and idle.

Every operation of the schema (health, metrics, models, completions, chat, adapter admin)
gets generated requests, valid and invalid (positive and negative generation modes).
A share of the generation bodies name a real model (the base or an adapter), so the fuzz
reaches the engine and not only the 404 for unknown models.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from runtime.async_engine import AsyncLLMEngine
from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.faults.conftest import engine_config, idle_problems
from tests.server_harness import wait_until

EXAMPLES_PER_OPERATION = 50
ADAPTERS = ("fuzz-target-a", "fuzz-target-b")


@pytest.fixture(scope="module")
def fuzz_engine(tiny_llama_dir: Path, tiny_adapters: dict[str, Path]):
    engine = AsyncLLMEngine(engine_config(tiny_llama_dir, max_model_len=64))
    # Names a generator is unlikely to produce, so a fuzzed unload cannot remove them.
    for name in ADAPTERS:
        engine.register_adapter(name, str(tiny_adapters[name[-1]]))
    yield engine
    engine.shutdown()


def test_no_5xx_for_any_generated_request(fuzz_engine, tmp_path: Path, tiny_adapters: dict[str, Path]) -> None:
    root = tmp_path / "root"
    root.mkdir()
    app = create_app(fuzz_engine, ServerOptions(enable_adapter_admin=True, adapter_roots=(root,), max_request_bytes=64 * 1024))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    models = [fuzz_engine.model_name, *ADAPTERS]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/models", "/health"}
    seen: dict[str, set[int]] = {}
    probe = {"model": ADAPTERS[0], "prompt": "probe before and after", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with TestClient(app) as client:
        before = client.post("/v1/completions", json=probe).json()["choices"][0]["text"]

    for op in operations:

        strategy = op.as_strategy(schemathesis.GenerationMode.POSITIVE) | op.as_strategy(schemathesis.GenerationMode.NEGATIVE)

        @given(case=strategy)
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case) -> None:
            body = case.body
            if isinstance(body, dict) and "model" in body and random.Random(repr(body)).random() < 0.5:
                body["model"] = random.Random(repr(body)).choice(models)  # reach the engine, not only the 404
            response = case.call()
            seen.setdefault(case.operation.path, set()).add(response.status_code)
            assert response.status_code < 500, f"{case.method} {case.formatted_path} {body!r} -> {response.status_code} {response.text[:500]}"

        fuzz()

    # The fuzz reached real generation and real validation errors.
    assert 200 in seen["/v1/completions"] and 400 in seen["/v1/completions"]
    assert wait_until(lambda: not idle_problems(fuzz_engine.snapshot(), registered=2), timeout_s=30), idle_problems(fuzz_engine.snapshot())
    assert sorted(a.name for a in fuzz_engine.adapters()) == list(ADAPTERS)  # nothing added or removed
    with TestClient(app) as client:  # healthy afterwards: answers exactly as before the fuzz
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json=probe).json()["choices"][0]["text"] == before
