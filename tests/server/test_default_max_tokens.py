"""A request without max_tokens gets a default that fits: completions' 16 and chat's "all the room
left" are capped to what the prompt leaves of max_model_len and of the KV pool. Only an explicit
max_tokens that does not fit is a 400 (in-process, httpx over ASGI, real engines)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for, make_engine_config

pytestmark = pytest.mark.anyio
SMALL_POOL = dict(max_model_len=96, block_size=8, num_kv_blocks=4)  # the pool holds 32 tokens, less than max_model_len


def prompt_of(engine: Any, min_tokens: int) -> tuple[str, int]:
    """A text prompt of at least ``min_tokens`` tokens (as the engine encodes it) and its length."""
    words = 1
    while len(engine.tokenizer.encode(" ".join(["hello"] * words))) < min_tokens:
        words += 1
    text = " ".join(["hello"] * words)
    return text, len(engine.tokenizer.encode(text))


async def test_completion_default_is_capped_near_max_model_len(engine) -> None:
    app = create_app(engine, ServerOptions())
    text, text_len = prompt_of(engine, engine.max_model_len - 10)
    assert text_len < engine.max_model_len - 1, "the prompt must leave room for a few tokens"
    ids = list(range(5, 5 + engine.max_model_len - 6))  # leaves 6 tokens of room
    body = {"model": engine.model_name, "temperature": 0, "ignore_eos": True}
    async with client_for(app) as c:
        by_ids = await c.post("/v1/completions", json={**body, "prompt": ids})
        by_text = await c.post("/v1/completions", json={**body, "prompt": text})
        both = await c.post("/v1/completions", json={**body, "prompt": [ids, [5, 6, 7]]})  # each prompt its own default
        explicit = await c.post("/v1/completions", json={**body, "prompt": ids, "max_tokens": 16})
    assert by_ids.status_code == 200, by_ids.text
    assert by_ids.json()["usage"]["completion_tokens"] == 6 and by_ids.json()["choices"][0]["finish_reason"] == "length"
    assert by_text.status_code == 200, by_text.text
    assert by_text.json()["usage"]["completion_tokens"] == min(16, engine.max_model_len - text_len)
    assert both.status_code == 200, both.text
    assert both.json()["usage"]["completion_tokens"] == 6 + 16
    assert explicit.status_code == 400 and "max_tokens" in explicit.json()["error"]["message"]  # sent, so named


@pytest.fixture(scope="module")
def small_pool_engine(tiny_llama_dir: Path):
    from runtime.async_engine import AsyncLLMEngine

    eng = AsyncLLMEngine(make_engine_config(tiny_llama_dir, **SMALL_POOL))
    yield eng
    eng.shutdown()


async def test_defaults_fit_a_kv_pool_smaller_than_max_model_len(small_pool_engine) -> None:
    engine = small_pool_engine
    pool_tokens = SMALL_POOL["num_kv_blocks"] * SMALL_POOL["block_size"]
    app = create_app(engine, ServerOptions())
    body = {"model": engine.model_name, "temperature": 0, "ignore_eos": True}
    async with client_for(app) as c:
        chat = await c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]})
        completion = await c.post("/v1/completions", json={**body, "prompt": list(range(5, 25))})  # 20 + 16 > 32
        explicit = await c.post("/v1/completions", json={**body, "prompt": list(range(5, 25)), "max_tokens": 16})
        # The largest explicit max_tokens accepted is the default's: prompt + output = the pool's 32 tokens, one more is a 400.
        filling = await c.post("/v1/completions", json={**body, "prompt": list(range(5, 25)), "max_tokens": pool_tokens - 20})
        one_over = await c.post("/v1/completions", json={**body, "prompt": list(range(5, 25)), "max_tokens": pool_tokens - 19})
    assert filling.status_code == 200 and filling.json()["usage"]["total_tokens"] == pool_tokens, filling.text
    assert one_over.status_code == 400 and one_over.json()["error"]["code"] == "context_length_exceeded", one_over.text
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["total_tokens"] == pool_tokens  # all the room the pool has, not max_model_len's
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == pool_tokens - 20
    assert explicit.status_code == 400 and "num_kv_blocks" in explicit.json()["error"]["message"]
    assert explicit.json()["error"]["param"] == "max_tokens"  # the prompt fits the pool; with its output it does not


async def test_errors_name_the_field_the_client_sent(small_pool_engine) -> None:
    """KV-pool refusals name max_tokens when the prompt alone fits, else the prompt; chat's
    max_completion_tokens is named as sent; an empty prompt among several is named by index."""
    engine = small_pool_engine
    app = create_app(engine, ServerOptions())
    body = {"model": engine.model_name, "temperature": 0}
    async with client_for(app) as c:
        too_long = await c.post("/v1/completions", json={**body, "prompt": list(range(5, 45)), "max_tokens": 1})
        chat = await c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50})
        empty = await c.post("/v1/completions", json={**body, "prompt": [[5, 6], []]})
        below_min = await c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
                                                                "min_tokens": 5})  # fmt: skip
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt", too_long.text
    assert "request" not in too_long.json()["error"]["message"].split(":")[0]  # no internal request id
    err = chat.json()["error"]
    assert chat.status_code == 400 and err["param"] == "max_completion_tokens" and err["message"].startswith("max_completion_tokens:"), err
    assert "max_tokens" not in err["message"]
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt.1", empty.text
    err = below_min.json()["error"]
    assert below_min.status_code == 400 and err["param"] == "min_tokens" and "max_completion_tokens=3" in err["message"], err
