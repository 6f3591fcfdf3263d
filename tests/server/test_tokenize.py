"""POST /tokenize and /detokenize: the counts the generation routes report, and clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def app(engine, adapter_root: Path):
    return create_app(engine, ServerOptions(adapter_roots=(adapter_root,)))


async def test_counts_match_what_generation_reports(app, engine) -> None:
    model = engine.adapters()[0].name
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo there"}]
    async with client_for(app) as c:
        tok = (await c.post("/tokenize", json={"model": model, "prompt": "héllo there", "return_token_strs": True})).json()
        comp = (await c.post("/v1/completions", json={"model": model, "prompt": "héllo there", "max_tokens": 1, "return_token_ids": True})).json()
        chat_tok = (await c.post("/tokenize", json={"model": model, "messages": messages})).json()
        chat = (await c.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1, "return_token_ids": True})).json()
        bare = (await c.post("/tokenize", json={"prompt": "héllo there", "add_special_tokens": False})).json()
        back = (await c.post("/detokenize", json={"tokens": bare["tokens"]})).json()
    assert tok["tokens"] == comp["choices"][0]["prompt_token_ids"] and tok["count"] == comp["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == engine.max_model_len and len(tok["token_strs"]) == tok["count"]
    assert chat_tok["tokens"] == chat["choices"][0]["prompt_token_ids"] and chat_tok["count"] == chat["usage"]["prompt_tokens"]
    assert bare["tokens"] == engine.tokenizer.encode("héllo there", add_special_tokens=False) and "token_strs" not in bare
    assert back == {"prompt": "héllo there"}


@pytest.mark.parametrize("route, body, status, param", [
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
])  # fmt: skip
async def test_bad_requests_are_openai_shaped(app, route, body, status, param) -> None:
    async with client_for(app) as c:
        r = await c.post(route, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param), err
