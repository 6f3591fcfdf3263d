"""API calls into a busy AsyncLLMEngine are served between steps, not after the batch.

The step thread held a plain Lock and re-took it right after every step, so an API call
(admission, abort, snapshot, adapter lookup) could wait until the whole batch finished.
Counted in engine steps, not seconds: a fair lock lets a call in within a step or two.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from runtime.async_engine import AsyncLLMEngine
from runtime.request import SamplingParams
from tests.faults.conftest import engine_config, idle_problems

MAX_STEPS_WAITED = 3  # the step in progress, plus slack for the call's own scheduling


def test_api_calls_get_the_lock_between_steps(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine(engine_config(tiny_llama_dir, max_model_len=256, num_kv_blocks=256))
    waited: list[int] = []

    async def scenario() -> None:
        async def generate(i: int) -> None:
            async for _ in engine.generate(f"long-{i}", [1 + i, 2, 3], SamplingParams(max_tokens=150, ignore_eos=True)):
                pass

        tasks = [asyncio.create_task(generate(i)) for i in range(6)]
        await asyncio.sleep(0.05)
        for _ in range(5):
            before = engine.engine.steps  # read without the lock: an int, only for counting
            snap = await asyncio.to_thread(engine.snapshot)
            waited.append(snap["steps"] - before)
            assert snap["running"] > 0  # answered while the batch is still running
        await asyncio.gather(*tasks)

    try:
        asyncio.run(scenario())
        assert max(waited) <= MAX_STEPS_WAITED, waited
        assert idle_problems(engine.snapshot()) == []
    finally:
        engine.shutdown()


def test_api_calls_are_not_held_up_by_an_adapter_load(tiny_llama_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    """When nothing can run until an adapter is read from disk, the step thread waits for the
    load without the engine lock: a snapshot and an abort answer while the load is in flight."""
    import threading

    release = threading.Event()
    engine = AsyncLLMEngine(engine_config(tiny_llama_dir, max_loras=1, max_cpu_loras=1))
    try:
        names = sorted(tiny_adapters)[:2]
        for name in names:  # the second registration drops the first from the 1-entry host tier
            engine.register_adapter(name, str(tiny_adapters[name]))
        pool = engine.engine.pool
        read = pool.loader
        pool.loader = lambda ref: (release.wait(30), read(ref))[1]  # a disk that answers when told

        async def scenario() -> None:
            async def generate() -> None:
                async for _ in engine.generate("slow", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), names[0]):
                    pass

            task = asyncio.create_task(generate())
            for _ in range(500):  # until the request is in and waits for its adapter's load
                if (await asyncio.to_thread(engine.snapshot))["pool"]["loads_in_flight"] == 1:
                    break
                await asyncio.sleep(0.01)
            for call in (engine.snapshot, lambda: engine.abort("slow")):
                result = await asyncio.wait_for(asyncio.to_thread(call), 20)  # a hang guard (the disk answers after 30 s)
                assert result is True or result["pool"]["loads_in_flight"] == 1
            # Both calls came back while the load still waits for the disk: neither waited on it (the old
            # loop held the lock for up to 1 s per load wait).
            assert (await asyncio.to_thread(engine.snapshot))["pool"]["loads_in_flight"] == 1
            release.set()
            await asyncio.wait_for(task, 10)
            pool.wait_for_load(timeout=10)
            async for _ in engine.generate("after", [1, 2], SamplingParams(max_tokens=1)):  # a step collects the load
                pass

        asyncio.run(scenario())
        assert idle_problems(engine.snapshot()) == []
    finally:
        release.set()
        engine.shutdown()


def test_event_loop_never_waits_for_the_engine_lock(tiny_llama_dir: Path) -> None:
    """A new request is admitted off the event loop: while a (simulated) long step holds the
    engine lock, other coroutines (other clients' streams) keep running."""
    import threading

    engine = AsyncLLMEngine(engine_config(tiny_llama_dir))
    held, release = threading.Event(), threading.Event()

    def long_step() -> None:
        with engine._lock:  # noqa: SLF001 - stands in for a step that takes a while
            held.set()
            release.wait(10)

    async def scenario() -> None:
        async def consume() -> int:
            return len([o async for o in engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))])

        holder = threading.Thread(target=long_step)
        holder.start()
        held.wait(10)
        task = asyncio.create_task(consume())
        for _ in range(10):
            await asyncio.sleep(0.01)  # runs only while the event loop is free
        # The loop ticked ten times while the lock's holder still held it (the old admission blocked the
        # loop until the holder let go, after its 10 s wait).
        assert holder.is_alive() and not release.is_set()
        assert not task.done()
        release.set()
        assert await asyncio.wait_for(task, 30) >= 1
        holder.join()

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        engine.shutdown()


def test_a_consumer_cancelled_twice_still_aborts_its_request(tiny_llama_dir: Path) -> None:
    """A disconnecting stream may be cancelled again while its abort waits behind busy helper
    threads (anyio cancel scopes repeat theirs): the abort must still run, so the request stops,
    its KV and id are freed, and the id can be used again."""
    import threading

    engine = AsyncLLMEngine(engine_config(tiny_llama_dir))
    held, release = threading.Event(), threading.Event()

    def long_step() -> None:
        with engine._lock:  # noqa: SLF001 - a step that takes a while
            held.set()
            release.wait(10)

    async def scenario() -> None:
        stream = engine.generate("victim", [1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True))
        await stream.__anext__()

        async def consume() -> None:
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        threading.Thread(target=long_step).start()
        held.wait(10)
        others = [asyncio.create_task(engine.generate(f"o{i}", [4, 5], SamplingParams(max_tokens=2)).__anext__()) for i in range(4)]
        await asyncio.sleep(0.05)  # the helper threads are all waiting for the lock
        task.cancel()
        await asyncio.sleep(0)  # its abort is queued behind them
        task.cancel()  # and a second cancellation arrives
        await asyncio.gather(task, return_exceptions=True)
        release.set()
        await asyncio.gather(*others, return_exceptions=True)
        for _ in range(200):
            if "victim" not in engine.engine._live:  # noqa: SLF001
                break
            await asyncio.sleep(0.05)
        assert reasons == ["abort"]  # stopped by the abort, not run to its 60 tokens
        async for out in engine.generate("victim", [1, 2], SamplingParams(max_tokens=1)):  # the id is free again
            assert out.finish_reason in (None, "length")

    reasons: list = []
    engine.add_observer(lambda m: m.request_id == "victim" and reasons.append(m.finish_reason))
    try:
        asyncio.run(scenario())
        assert idle_problems(engine.snapshot()) == []
    finally:
        release.set()
        engine.shutdown()


def test_a_shutdown_waiting_for_the_lock_goes_before_callers_that_queued_after_it(tiny_llama_dir: Path, monkeypatch) -> None:
    """Shutdown waited for the engine lock in SHUTDOWN_POLL_S slices, each a fresh ``acquire``
    that left the lock's queue when it timed out and joined it again at the back: snapshots (or
    admissions) queued after it went first, however long it had waited. Now it keeps its place."""
    import threading
    import time

    import runtime.async_engine as async_engine
    from runtime.engine import LLMEngine

    monkeypatch.setattr(async_engine, "SHUTDOWN_POLL_S", 0.005)
    order: list[str] = []

    class Recorded(LLMEngine):
        def snapshot(self):  # type: ignore[no-untyped-def]
            order.append("a snapshot")
            return super().snapshot()

        def fail_all(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            order.append("shutdown")
            return super().fail_all(*args, **kwargs)

    engine = AsyncLLMEngine(None, engine=Recorded(engine_config(tiny_llama_dir)))
    lock = engine._lock  # noqa: SLF001 - a long step stands in as its holder

    def queued_for_the_lock(count: int) -> bool:
        for _ in range(3000):
            with lock._mutex:  # noqa: SLF001
                if len(lock._waiters) >= count:  # noqa: SLF001
                    return True
            time.sleep(0.001)
        return False

    lock.acquire(holder="a step")
    shutdown = threading.Thread(target=engine.shutdown, args=(0.0, 60.0))  # no drain: straight to failing the requests
    snapshots = [threading.Thread(target=engine.snapshot) for _ in range(2)]
    try:
        shutdown.start()
        assert queued_for_the_lock(1)
        for thread in snapshots:
            thread.start()
        assert queued_for_the_lock(3)
        time.sleep(20 * async_engine.SHUTDOWN_POLL_S)  # shutdown read its deadline again many times meanwhile
    finally:
        lock.release()
        shutdown.join(30)
        for thread in snapshots:
            thread.join(30)
    assert order[:3] == ["shutdown", "a snapshot", "a snapshot"], order
    assert not shutdown.is_alive() and not engine.step_abandoned
