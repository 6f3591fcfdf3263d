"""Chat templates render off the event loop: a template that takes long (here: one that waits for
the test to let it go) held up every other request, ``/health`` included, while it rendered.

Nothing depends on timing: the template waits on an event that the test sets only after
``/health`` has answered; had the render run on the event loop, ``/health`` could only answer
once the wait had given up (``SAFETY_S``), which the test sees.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from runtime.tokenizer import _compile_chat_template
from tests.server.conftest import client_for

pytestmark = pytest.mark.anyio
SAFETY_S = 5.0  # how long the template waits at most, should it block the event loop


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
async def test_a_slow_chat_template_does_not_hold_up_other_requests(engine, monkeypatch, route: str) -> None:
    entered, release, gave_up = threading.Event(), threading.Event(), threading.Event()

    def wait_for_release() -> str:
        entered.set()
        if not release.wait(SAFETY_S):
            gave_up.set()
        return ""

    template = _compile_chat_template("{{ wait_for_release() }}{% for m in messages %}{{ m['content'] }}{% endfor %}", "the test's template")
    template.environment.globals["wait_for_release"] = wait_for_release
    monkeypatch.setattr(engine.tokenizer, "_compiled_template", template)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    if route != "/tokenize":
        body.update(model=engine.model_name, max_tokens=2)
    async with client_for(create_app(engine, ServerOptions())) as c:
        pending = asyncio.create_task(c.post(route, json=body))
        while not entered.is_set() and not pending.done():
            await asyncio.sleep(0.01)
        health = await c.get("/health")
        assert not gave_up.is_set(), "/health waited for the chat template's render: it ran on the event loop"
        release.set()
        r = await pending
    assert health.status_code == 200
    assert r.status_code == 200, r.text
