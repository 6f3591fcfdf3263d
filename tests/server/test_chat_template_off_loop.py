"""Chat templates render off the event loop: a template that takes long (here: one that waits for
the test to let it go) held up every other request, ``/health`` included, while it rendered.
They render on threads of their own (``ChatRenderWorkers``), not the event loop's default
executor, which ``/metrics`` and long prompts' tokenizing need, and a render past the bound of
renders in progress is a 429.

Nothing depends on timing: the template waits on an event that the test sets only after
``/health`` (or the other routes) has answered; had the render run on the event loop (or taken
the threads those routes need), they could only answer once the wait had given up
(``SAFETY_S``), which the test sees.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from runtime.server import app as app_module, generation
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


class StuckRenders:
    """A chat template whose renders wait until ``release`` is set (at most ``3 * SAFETY_S``),
    noting the names of the threads they render in."""

    def __init__(self, engine, monkeypatch) -> None:
        self.release = threading.Event()
        self.threads: list[str] = []
        template = _compile_chat_template("{{ wait_for_release() }}{% for m in messages %}{{ m['content'] }}{% endfor %}", "the test's template")
        template.environment.globals["wait_for_release"] = self._wait
        monkeypatch.setattr(engine.tokenizer, "_compiled_template", template)

    def _wait(self) -> str:
        self.threads.append(threading.current_thread().name)
        self.release.wait(3 * SAFETY_S)
        return ""

    async def entered(self, count: int, tasks: list[asyncio.Task]) -> None:
        while len(self.threads) < count and not any(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        assert len(self.threads) >= count, [t.result().text for t in tasks if t.done()]


async def test_stuck_renders_do_not_take_the_threads_metrics_and_long_prompts_need(engine, monkeypatch, small_default_executor) -> None:
    """As many stuck renders as the event loop's default executor has threads: they took them all
    (renders ran on ``asyncio.to_thread``), and a long prompt's tokenizing and ``/metrics``, which
    need one, waited until a render ended. Renders now run on ChatRenderWorkers' own threads."""
    monkeypatch.setattr(generation, "LONG_TEXT_CHARS", 1)  # every text is encoded in a worker thread
    renders = StuckRenders(engine, monkeypatch)
    async with client_for(create_app(engine, ServerOptions())) as c:
        stuck = [asyncio.create_task(c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}))
                 for _ in range(small_default_executor)]
        try:
            await renders.entered(small_default_executor, stuck)
            try:
                tokenized = await asyncio.wait_for(c.post("/tokenize", json={"prompt": "a long prompt"}), SAFETY_S)
                scrape = await asyncio.wait_for(c.get("/metrics"), SAFETY_S)
            except asyncio.TimeoutError:
                pytest.fail("a route that needs one of the default executor's threads waited for the stuck renders")
            assert not any(t.done() for t in stuck)
        finally:
            renders.release.set()
        replies = await asyncio.gather(*stuck)
    assert tokenized.status_code == 200 and tokenized.json()["count"] > 0
    assert scrape.status_code == 200 and "lorafleet_kv_blocks_free" in scrape.text
    assert [r.status_code for r in replies] == [200] * small_default_executor, [r.text for r in replies]
    assert all(name.startswith("lorafleet-chat-template") for name in renders.threads), renders.threads


async def test_renders_past_the_bound_are_429s(engine, monkeypatch) -> None:
    """One render thread, at most two renders in progress: of a render that runs (stuck), one that
    waits for the thread and a third, the third is refused at once; the others then end."""
    monkeypatch.setattr(app_module, "CHAT_RENDER_THREADS", 1, raising=False)
    monkeypatch.setattr(app_module, "CHAT_RENDER_MAX_IN_PROGRESS", 2, raising=False)
    renders = StuckRenders(engine, monkeypatch)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    async with client_for(create_app(engine, ServerOptions())) as c:
        running = asyncio.create_task(c.post("/tokenize", json=body))
        try:
            await renders.entered(1, [running])
            others = [asyncio.create_task(c.post("/tokenize", json=body)),
                      asyncio.create_task(c.post("/v1/chat/completions", json={**body, "model": engine.model_name, "max_tokens": 2}))]
            try:
                refused = await asyncio.wait_for(next(asyncio.as_completed(others)), SAFETY_S)
            except asyncio.TimeoutError:
                pytest.fail("no render was refused past the bound: all three were left waiting")
        finally:
            renders.release.set()
        replies = [await running, *await asyncio.gather(*others)]
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "too_many_chat_renders" and error["type"] == "rate_limit_error"
    assert "at most 2" in error["message"] and "retry" in error["message"]
    assert sorted(r.status_code for r in replies) == [200, 200, 429], [r.text for r in replies]
    assert len(renders.threads) == 2  # the refused render never ran


@pytest.mark.parametrize("workers", ["chat_renders", "admin_workers"])
async def test_the_render_threads_end_with_the_app(engine, workers: str) -> None:
    """The app's lifespan ends (the server's shutdown): its render threads, and its admin threads
    (which used to outlive every app), end once their work has. An app used again afterwards (a
    test client entering it once more; schemathesis's calls, which drive it without a lifespan)
    gets new threads: the pools used to stay shut down, every chat render a 500."""
    app = create_app(engine, ServerOptions(enable_adapter_admin=True))
    pool = getattr(app.state.lorafleet, workers)
    async with app.router.lifespan_context(app):
        first = await pool.run(threading.current_thread)
    first.join(timeout=SAFETY_S)
    assert not first.is_alive(), "the pool's thread outlived the app's lifespan"
    again = await pool.run(threading.current_thread)  # no lifespan at all
    assert again is not first
    async with app.router.lifespan_context(app):
        assert await pool.run(lambda: "again") == "again"


def test_the_docs_give_the_render_bounds() -> None:
    from pathlib import Path

    from runtime.chat_template_budget import MAX_RENDER_SECONDS, MAX_TEMPLATE_STEPS
    from runtime.server.chat_render_workers import CHAT_RENDER_MAX_IN_PROGRESS, CHAT_RENDER_THREADS

    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text(encoding="utf-8").split())
    assert f"rendered on {CHAT_RENDER_THREADS} threads kept for chat template renders" in text
    assert f"At most {CHAT_RENDER_MAX_IN_PROGRESS} renders are in progress" in text
    assert f"at most 1 Mi ({MAX_TEMPLATE_STEPS}) steps" in text and f"and at most {MAX_RENDER_SECONDS:g} s;" in text
