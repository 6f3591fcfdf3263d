"""Adapter admin calls block a thread for as long as they take (reading and hashing the files;
under --ray, the registry's round trip to every replica). They ran on the event loop's default
executor, which also encodes long prompts and renders /metrics: a few slow loads at once
(``min(32, cores + 4)`` threads: 6 on 2 cores) stalled every long prompt and every scrape until
one ended. They now run on the admin routes' own threads, at most ``ADMIN_MAX_IN_PROGRESS`` at
a time; one more is a 429.

The loads here block on an Event until the test has seen the other routes answer; nothing
depends on timing (a stalled route would hang until the safety timeout, and fail).
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest

from runtime.server import generation
from runtime.server.admin_workers import ADMIN_MAX_IN_PROGRESS, ADMIN_THREADS, AdminBusy, AdminWorkers
from runtime.server import app as app_module
from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for

pytestmark = pytest.mark.anyio
SAFETY_S = 10.0  # how long a route may wait for a worker thread before the test calls it stalled
HOLD_S = 3 * SAFETY_S  # how long a blocked admin call waits for the test's release at most


class BlockedAdminCalls:
    """Stands in for ``engine.register_adapter`` / ``unregister_adapter``: each call counts itself
    in and blocks until ``release`` is set (a slow read of a large adapter, a slow disk)."""

    def __init__(self, engine: Any) -> None:
        self.release = threading.Event()
        self.entered = 0
        self._lock = threading.Lock()
        self._entered_enough: dict[int, threading.Event] = {}
        self._register = engine.register_adapter
        self.really_unregister = engine.unregister_adapter

    def wait_entered(self, count: int) -> bool:
        with self._lock:
            event = self._entered_enough.setdefault(count, threading.Event())
            if self.entered >= count:
                event.set()
        return event.wait(SAFETY_S)

    def _enter(self) -> None:
        with self._lock:
            self.entered += 1
            for count, event in self._entered_enough.items():
                if self.entered >= count:
                    event.set()
        self.release.wait(HOLD_S)

    def register(self, name: str, path: str, **within: Any) -> Any:
        self._enter()
        return self._register(name, path, **within)

    def unregister(self, name: str) -> None:
        self._enter()


def admin_app(engine: Any, adapter_root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, BlockedAdminCalls]:
    calls = BlockedAdminCalls(engine)
    monkeypatch.setattr(engine, "register_adapter", calls.register)
    monkeypatch.setattr(engine, "unregister_adapter", calls.unregister)
    return create_app(engine, ServerOptions(enable_adapter_admin=True, adapter_roots=(adapter_root,))), calls


async def started(tasks: list[asyncio.Task], calls: BlockedAdminCalls, count: int) -> None:
    """Wait (off the loop, on a thread of its own: the default executor's may all be taken) until
    ``count`` admin calls are blocked in their threads."""
    with ThreadPoolExecutor(max_workers=1) as waiter:
        entered = await asyncio.get_running_loop().run_in_executor(waiter, calls.wait_entered, count)
    assert entered, f"{count} admin calls never started: " + str([t.result().text for t in tasks if t.done()])


async def answered(request: Callable[[], Any]) -> Any:
    return await asyncio.wait_for(request(), SAFETY_S)


async def test_slow_adapter_loads_do_not_stall_long_prompts_or_metrics(engine, adapter_root: Path, monkeypatch, small_default_executor) -> None:
    monkeypatch.setattr(generation, "LONG_TEXT_CHARS", 1)  # every text is encoded in a worker thread
    app, calls = admin_app(engine, adapter_root, monkeypatch)
    async with client_for(app) as c:
        loads = [asyncio.create_task(c.post("/v1/load_lora_adapter", json={"lora_name": f"slow{i}", "lora_path": str(adapter_root / "a")}))
                 for i in range(small_default_executor)]
        try:
            await started(loads, calls, small_default_executor)
            try:
                tokenized = await answered(lambda: c.post("/tokenize", json={"model": engine.model_name, "prompt": "a long prompt"}))
                scrape = await answered(lambda: c.get("/metrics"))
            except asyncio.TimeoutError:
                pytest.fail("a route that needs a worker thread waited for the slow adapter loads")
            assert not any(load.done() for load in loads)
        finally:
            calls.release.set()
        replies = await asyncio.gather(*loads)
    assert tokenized.status_code == 200 and tokenized.json()["count"] > 0
    assert scrape.status_code == 200 and "lorafleet_kv_blocks_free" in scrape.text
    assert [r.status_code for r in replies] == [200] * small_default_executor, [r.text for r in replies]
    for i in range(small_default_executor):
        calls.really_unregister(f"slow{i}")


async def test_admin_calls_past_the_bound_are_429s(engine, adapter_root: Path, monkeypatch) -> None:
    """One admin thread, at most two calls in progress: of a load that runs, a load that waits for
    the thread and an unload, the one that comes last is refused at once; the others then end."""
    monkeypatch.setattr(app_module, "ADMIN_THREADS", 1)
    monkeypatch.setattr(app_module, "ADMIN_MAX_IN_PROGRESS", 2)
    app, calls = admin_app(engine, adapter_root, monkeypatch)
    async with client_for(app) as c:
        running = asyncio.create_task(c.post("/v1/load_lora_adapter", json={"lora_name": "bound0", "lora_path": str(adapter_root / "a")}))
        try:
            await started([running], calls, 1)
            others = [asyncio.create_task(c.post("/v1/load_lora_adapter", json={"lora_name": "bound1", "lora_path": str(adapter_root / "a")})),
                      asyncio.create_task(c.post("/v1/unload_lora_adapter", json={"lora_name": "bound0"}))]
            try:
                refused = await answered(lambda: next(asyncio.as_completed(others)))
            except asyncio.TimeoutError:
                pytest.fail("no admin call was refused past the bound: all three were left waiting")
        finally:
            calls.release.set()
        replies = [await running, *await asyncio.gather(*others)]
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "too_many_admin_requests" and error["type"] == "rate_limit_error"
    assert "at most 2" in error["message"] and "retry" in error["message"]
    assert sorted(r.status_code for r in replies) == [200, 200, 429], [r.text for r in replies]
    assert calls.entered == 2  # the refused call never ran
    for name in {"bound0", "bound1"} & {info.name for info in engine.adapters()}:
        calls.really_unregister(name)


async def test_a_call_counts_until_its_work_ends_and_one_left_waiting_is_dropped() -> None:
    """A caller that goes away leaves its running call counted (its thread is still busy) and
    drops a call still waiting for a thread, which never runs."""
    workers, release, ran = AdminWorkers(threads=1, max_in_progress=2), threading.Event(), []

    def work(tag: str) -> str:
        ran.append(tag)
        release.wait(HOLD_S)
        return tag

    running = asyncio.create_task(workers.run(work, "running"))
    waiting = asyncio.create_task(workers.run(work, "waiting"))
    await asyncio.sleep(0)  # both tasks have counted themselves in
    assert workers.in_progress == 2
    with pytest.raises(AdminBusy, match="at most 2"):
        await workers.run(work, "refused")
    running.cancel()
    waiting.cancel()
    await asyncio.gather(running, waiting, return_exceptions=True)
    assert workers.in_progress == 1  # the waiting call was dropped; the running one goes on
    release.set()
    assert await workers.run(work, "later") == "later"
    assert ran == ["running", "later"] and workers.in_progress == 0


@pytest.mark.parametrize("threads, max_in_progress", [(0, 4), (True, 4), (2, 1), (2, "4")])
def test_admin_workers_refuse_bad_sizes(threads, max_in_progress) -> None:
    with pytest.raises(ValueError, match="AdminWorkers"):
        AdminWorkers(threads, max_in_progress)


def test_the_api_doc_gives_the_admin_bounds() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text(encoding="utf-8")
    section = text[text.index("## Adapter admin"):text.index("## Health, metrics and schema")]
    assert f"run on {ADMIN_THREADS} threads of their own" in section and f"At most {ADMIN_MAX_IN_PROGRESS} loads and unloads" in section
