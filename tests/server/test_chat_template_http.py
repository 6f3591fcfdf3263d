"""The chat template over HTTP, on a copy of the tiny llama with a template of the test's own:
what the template raises while rendering a request's messages is a 400 naming the error (and
logged), never a 500, unless it is not a data error."""
from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for, make_engine_config

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def served(tiny_llama_dir: Path, tmp_path: Path, template: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a server whose model is the tiny llama with ``template`` as its chat template."""
    from runtime.async_engine import AsyncLLMEngine

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    engine = AsyncLLMEngine(make_engine_config(model))
    try:
        async with client_for(create_app(engine, ServerOptions()), raise_app_exceptions=False) as c:
            c.model_name = engine.model_name  # type: ignore[attr-defined]
            yield c
    finally:
        engine.shutdown()


def chat_body(c: httpx.AsyncClient, messages: list[dict], **fields) -> dict:
    return {"model": c.model_name, "messages": messages, "max_tokens": 2, "temperature": 0, **fields}  # type: ignore[attr-defined]


# A template that works out the share of the turns that are the user's: it divides by their number.
PER_USER_TURN = ("{% set users = messages | selectattr('role', 'equalto', 'user') | list | length %}"
                 "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "[{{ (messages | length) // users }} turns per user turn]<|assistant|>")
# A reasoning template that keeps only what follows </think> of an earlier assistant turn.
ANSWER_ONLY = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}"
               "{{ m['content'][m['content'].index('</think>') + 8:] }}{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}<|assistant|>")


@pytest.mark.parametrize("template, messages, error", [
    (PER_USER_TURN, [{"role": "system", "content": "no user here"}], "ZeroDivisionError: integer division or modulo by zero"),
    (ANSWER_ONLY, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no think tag"}, {"role": "user", "content": "so?"}],
     "ValueError: substring not found"),
])
async def test_a_template_failing_on_the_request_values_is_a_400_naming_the_error(tiny_llama_dir, tmp_path, caplog, template, messages, error):
    """It was a 500 "internal server error" (ZeroDivisionError, TypeError, KeyError, ...) or, for a
    ValueError, a 400 that did not say the template had failed ("messages: substring not found")."""
    async with served(tiny_llama_dir, tmp_path, template) as c:
        fine = await c.post("/v1/chat/completions", json=chat_body(c, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<think>a</think>b"}, {"role": "user", "content": "y"}]))
        assert fine.status_code == 200, fine.text
        with caplog.at_level(logging.WARNING, logger="lorafleet.server"):
            r = await c.post("/v1/chat/completions", json=chat_body(c, messages))
            tokenize = await c.post("/tokenize", json={"messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": f"messages: chat_template: failed on these inputs with {error}", "type": "invalid_request_error",
                                 "param": "messages", "code": "invalid_parameter"}
    assert tokenize.status_code == 400 and tokenize.json()["error"] == r.json()["error"]
    logged = [rec for rec in caplog.records if rec.name == "lorafleet.server" and error in rec.getMessage()]
    assert logged and all(rec.levelno == logging.WARNING and rec.exc_info for rec in logged)  # the traceback, for the operator


async def test_a_template_failing_otherwise_is_still_a_500(tiny_llama_dir, tmp_path, caplog):
    """A template that recurses without end fails for every request: a server fault (RecursionError), logged as one."""
    async with served(tiny_llama_dir, tmp_path, "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}") as c:
        with caplog.at_level(logging.ERROR, logger="lorafleet.server"):
            r = await c.post("/v1/chat/completions", json=chat_body(c, [{"role": "user", "content": "hi"}]))
    assert r.status_code == 500 and "RecursionError" in r.json()["error"]["message"]
    assert any(rec.levelno == logging.ERROR and rec.exc_info for rec in caplog.records if rec.name == "lorafleet.server")
