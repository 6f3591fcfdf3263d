"""The event loop never waits for the engine lock, which the step thread holds for a whole step.

The test holds the lock from another thread (as a long step would) until it has seen the
route answer, or the event loop run on, while the lock is held. Nothing depends on timing:
a route that took the lock on the event loop would freeze it until the safety timeout, and
the test sees the lock already released.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Iterator

import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for

pytestmark = pytest.mark.anyio
SAFETY_S = 5.0  # how long the lock is held at most, should the event loop be blocked on it


@pytest.fixture(scope="module")
def app(engine):
    return create_app(engine, ServerOptions())


@contextlib.contextmanager
def engine_lock_held(engine: Any) -> Iterator[threading.Event]:
    """Hold the engine lock in another thread until the block ends; yields an event set once it lets go."""
    held, release, released = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with engine._lock:  # noqa: SLF001 - what the step thread does for a whole step
            held.set()
            release.wait(SAFETY_S)
            released.set()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    try:
        yield released
    finally:
        release.set()
        thread.join(10)


async def test_model_lookups_answer_while_a_step_holds_the_lock(app, engine) -> None:
    adapter = engine.adapters()[0].name
    async with client_for(app) as c:
        with engine_lock_held(engine) as released:
            models = await c.get("/v1/models")
            missing = await c.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi", "max_tokens": 2})
            assert not released.is_set(), "a model lookup waited for the engine lock on the event loop"
            # A real request resolves its model at once, then waits for admission off the loop.
            pending = asyncio.create_task(c.post("/v1/completions", json={"model": adapter, "prompt": "hi", "max_tokens": 2}))
            await asyncio.sleep(0.05)
            assert not released.is_set() and not pending.done()
        assert (await pending).status_code == 200
    assert models.status_code == 200 and adapter in [m["id"] for m in models.json()["data"]]
    assert missing.status_code == 404


async def test_metrics_scrape_waits_for_the_lock_off_the_event_loop(app, engine) -> None:
    async with client_for(app) as c:
        with engine_lock_held(engine) as released:
            scrape = asyncio.create_task(c.get("/metrics"))
            await asyncio.sleep(0.05)  # the event loop runs on while the scrape waits
            assert not released.is_set(), "the /metrics scrape blocked the event loop on the engine lock"
            assert not scrape.done()  # it needs the engine's snapshot, so it waits for the step to end
        r = await scrape
    assert r.status_code == 200 and "lorafleet_kv_blocks_free" in r.text
