"""Chat prompts carry the template's special tokens once: no second BOS from encoding."""
from __future__ import annotations

import httpx
import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from runtime.tokenizer import Tokenizer
from tests.server.conftest import make_engine_config

pytestmark = pytest.mark.anyio
DEMO_BASE = "runtime/demo_assets/base"  # its template starts with {{ bos_token }}, its tokenizer adds BOS too


async def test_chat_prompt_has_one_bos():
    from runtime.async_engine import AsyncLLMEngine

    tok = Tokenizer(DEMO_BASE)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered.startswith("<bos>") and tok.encode(rendered)[:2] == [tok.bos_token_id] * 2  # what encoding with specials did
    want = tok.encode(rendered, add_special_tokens=False)
    assert want[0] == tok.bos_token_id and want[1] != tok.bos_token_id
    engine = AsyncLLMEngine(make_engine_config(DEMO_BASE, max_model_len=128, max_lora_rank=16))
    try:
        app = create_app(engine, ServerOptions())
        body = {"model": engine.model_name, "messages": messages, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as c:
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            default = (await c.post("/v1/chat/completions", json={k: v for k, v in body.items() if k != "max_tokens"})).json()
    finally:
        engine.shutdown()
    assert out["choices"][0]["prompt_token_ids"] == want
    assert out["usage"]["prompt_tokens"] == len(want)
    # No max_tokens: the default is the room left in the context, counted on the same ids.
    assert default["usage"]["prompt_tokens"] == len(want)
    assert default["usage"]["completion_tokens"] <= 128 - len(want)
