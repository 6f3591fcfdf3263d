"""AsyncLLMEngine and LLMEngine under failures and races: a step that fails after finishing
requests, an observer that raises, a consumer's event loop closed under the step thread, a
request id reused right after an abort, a burst of admissions, and LLM/engine use after close."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from runtime.async_engine import AsyncLLMEngine, EngineDeadError
from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.output_mailbox import OutputMailbox
from runtime.request import RequestOutput, SamplingParams
from tests.engine_helpers import HeldLoadEngine, HeldReadEngine, StuckStepEngine, run_to_completion


def config(model: Path, **overrides) -> EngineConfig:
    values = dict(model=str(model), device="cpu", dtype="float32", max_loras=2, max_lora_rank=16, max_cpu_loras=4,
                  max_num_seqs=64, max_model_len=96, block_size=8, num_kv_blocks=256, max_num_batched_tokens=512)
    values.update(overrides)
    return EngineConfig(**values)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_a_step_failing_after_it_finished_a_request_keeps_that_request_s_end(tiny_llama_dir: Path) -> None:
    """The request the failed step finished gets its real final output ("length"); the others
    get the error from fail_all. Before, the finished one got nothing: its stream hung."""
    engine = LLMEngine(config(tiny_llama_dir))
    finished: list[str] = []
    engine.add_observer(lambda m: finished.append(m.request_id))
    engine.add_request("short", [5, 6, 7], greedy(2))
    engine.add_request("long", [5, 6, 7], greedy(40))
    real_prefetch = engine.pool.prefetch

    def prefetch(refs):  # type: ignore[no-untyped-def]
        if "short" in finished:
            engine.pool.prefetch = real_prefetch
            raise RuntimeError("injected: a device copy failed")
        return real_prefetch(refs)

    engine.pool.prefetch = prefetch
    seen: list[RequestOutput] = []
    with pytest.raises(RuntimeError, match="injected"):
        while True:
            seen += engine.step()
    ends = {o.request_id: o for o in engine.fail_all("engine step failed")}
    assert ends["short"].finish_reason == "length" and len(ends["short"].token_ids) == 2
    assert ends["long"].finish_reason == "error" and not engine.has_unfinished()
    engine.close()


def test_an_observer_that_raises_fails_neither_the_request_nor_the_engine(tiny_llama_dir: Path, caplog) -> None:
    engine = LLMEngine(config(tiny_llama_dir))

    def broken(metrics):  # type: ignore[no-untyped-def]
        raise ValueError("a metrics bug")

    engine.add_observer(broken)
    engine.add_request("r", [5, 6, 7], greedy(3))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finish_reason == "length" and len(outputs[-1].token_ids) == 3
    assert "request observer" in caplog.text and "a metrics bug" in caplog.text
    engine.close()


def test_an_abort_whose_output_is_dropped_leaves_nothing_for_a_reused_id(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(config(tiny_llama_dir))
    engine.add_request("x", [5, 6, 7], greedy(5))
    assert engine.abort("x")
    engine.drop_pending(["x"])
    assert not engine.has_unfinished() and engine.step() == []
    engine.add_request("x", [5, 6, 7], greedy(2))  # the same id again: its own outputs only
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.finish_reason for o in outputs if o.finished] == ["length"]
    engine.close()


def test_a_closed_consumer_loop_does_not_kill_the_step_thread(tiny_llama_dir: Path) -> None:
    """A consumer's event loop can close between any check and the hand-over: the output is
    dropped, the queue forgotten, and the step thread carries on serving the others."""
    engine = AsyncLLMEngine(config(tiny_llama_dir))
    try:
        closed = asyncio.new_event_loop()
        closed.close()
        with engine._queues_lock:
            engine._queues["gone"] = (closed, OutputMailbox())
        out = RequestOutput("gone", None, (1,), "a", (1,), "a", False, None, None, (5,))
        engine._dispatch([out])  # raised RuntimeError("Event loop is closed") in the step thread before
        assert "gone" not in engine._queues

        async def other() -> str:
            outs = [o async for o in engine.generate("other", [5, 6, 7], greedy(3))]
            return outs[-1].finish_reason

        assert asyncio.run(asyncio.wait_for(other(), 30)) == "length"
        assert engine.running and engine.dead_error is None
    finally:
        engine.shutdown()


def test_a_step_failure_ends_every_stream(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine(config(tiny_llama_dir))
    core = engine.engine
    real_execute = core.runner.execute
    calls = {"n": 0}

    def execute(steps):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected: the device fell over")
        return real_execute(steps)

    core.runner.execute = execute

    async def consume(rid: str, n: int) -> str:
        outs = [o async for o in engine.generate(rid, [5, 6, 7], greedy(n))]
        return outs[-1].finish_reason

    async def run() -> list[str]:
        return await asyncio.wait_for(asyncio.gather(consume("a", 2), consume("b", 30), consume("c", 30)), 30)

    try:
        reasons = asyncio.run(run())
        assert reasons[1:] == ["error", "error"] and reasons[0] in ("length", "error")
        assert engine.dead_error is not None and "injected" in engine.dead_error and not engine.accepting
    finally:
        engine.shutdown()


def test_a_burst_is_admitted_within_a_step_not_four_per_step(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine(config(tiny_llama_dir))
    admitted_at: list[int] = []
    real_add = engine.engine.add_checked

    def add_checked(request):  # type: ignore[no-untyped-def]
        real_add(request)
        admitted_at.append(engine.engine.steps)

    engine.engine.add_checked = add_checked
    real_execute = engine.engine.runner.execute

    def slow_execute(steps):  # type: ignore[no-untyped-def]
        time.sleep(0.02)  # steps of a real model's length, so the burst's coroutines all start within a step or two
        return real_execute(steps)

    engine.engine.runner.execute = slow_execute

    async def drain(rid: str, n: int) -> None:
        async for _ in engine.generate(rid, [5, 6, 7, 8], greedy(n)):
            pass

    async def run() -> None:
        busy = [asyncio.create_task(drain(f"bg{i}", 60)) for i in range(4)]
        while engine.engine.steps < 3:  # the engine is stepping
            await asyncio.sleep(0.01)
        first = len(admitted_at)
        await asyncio.gather(*(drain(f"b{i}", 2) for i in range(32)))
        burst = admitted_at[first:]
        assert len(burst) == 32 and max(burst) - min(burst) <= 2, burst  # 4 per step before: over 8 steps
        await asyncio.gather(*busy)

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        engine.shutdown()


def test_use_after_shutdown_is_an_engine_dead_error(tiny_llama_dir: Path, tiny_adapters) -> None:
    engine = AsyncLLMEngine(config(tiny_llama_dir))
    engine.register_adapter("kept", str(tiny_adapters["b"]))

    async def use_it() -> None:  # on the device: unregistering it then reached the released runner
        async for _ in engine.generate("used", [5, 6], greedy(2), "kept"):
            pass

    asyncio.run(use_it())
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        engine.register_adapter("a", str(tiny_adapters["a"]))
    with pytest.raises(EngineDeadError):  # was a RuntimeError from the runner, after the registry had dropped the name
        engine.unregister_adapter("kept")
    assert [a.name for a in engine.adapters()] == [i.name for i in engine.engine.registry.infos()] == ["kept"]

    async def late() -> None:
        async for _ in engine.generate("late", [5], greedy(1)):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(late())


def test_shutdown_refuses_a_negative_or_nan_length_before_it_begins(tiny_llama_dir: Path) -> None:
    """shutdown() took any timeout and step_grace_s: NaN never passes a deadline, so the wait for a
    step still running after the drain, meant to end step_grace_s later, never ended; a negative
    one was no drain at all. Both are a ValueError now, before anything begins: the engine still
    takes requests, and a shutdown with proper lengths then works."""
    engine = AsyncLLMEngine(config(tiny_llama_dir))
    try:
        for kwargs in ({"timeout": float("nan")}, {"timeout": -5.0}, {"timeout": 1.0, "step_grace_s": float("nan")}):
            name = "step_grace_s" if "step_grace_s" in kwargs else "timeout"
            with pytest.raises(ValueError, match=f"{name} must be a number of seconds >= 0"):
                engine.shutdown(**kwargs)
            with pytest.raises(ValueError, match=f"{name} must be a number of seconds >= 0"):
                engine.shutdown_in_background(**kwargs)
            assert engine.accepting and engine.dead_error is None
    finally:
        engine.shutdown(5.0)
    assert engine.dead_error == "engine was shut down"


def test_register_adapter_async_leaves_the_event_loop_s_default_executor_alone(tiny_llama_dir: Path, tiny_adapters) -> None:
    """register_adapter_async ran the whole load in the loop's default executor (asyncio.to_thread),
    whose threads a server's other work waits for; it now reads the files in the engine's file
    reader thread and installs from an admission helper thread."""
    from concurrent.futures import ThreadPoolExecutor

    class RecordingExecutor(ThreadPoolExecutor):
        def __init__(self) -> None:
            super().__init__(max_workers=1)
            self.used = 0

        def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.used += 1
            return super().submit(fn, *args, **kwargs)

    engine = AsyncLLMEngine(config(tiny_llama_dir))
    default = RecordingExecutor()

    async def register() -> object:
        asyncio.get_running_loop().set_default_executor(default)
        return await engine.register_adapter_async("a", str(tiny_adapters["a"]))

    try:
        ref = asyncio.run(register())
        assert ref.name == "a" and [info.name for info in engine.adapters()] == ["a"]
        assert default.used == 0
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            asyncio.run(engine.register_adapter_async("b", str(tiny_adapters["b"])))
    finally:
        engine.shutdown()
        default.shutdown()


@pytest.mark.parametrize("calls", ["one call", "a later call with a shorter timeout"])
def test_shutdown_does_not_wait_past_its_deadline_for_a_stuck_adapter_file_read(tiny_llama_dir: Path, tiny_adapters, caplog, calls: str) -> None:
    """After the drain, shutdown waited for the adapter file read in progress without a bound
    (``_files.shutdown(wait=True)``): a read stuck on a network mount held it, and a second
    shutdown() with a shorter timeout waited for it too. Now the read is waited for until the
    deadline of the calls under way, then left to its thread (it cannot be interrupted), with one
    WARNING naming what was left; its caller, and that of a read queued behind it, get an
    EngineDeadError at once instead of waiting for it."""
    import logging

    inner = HeldReadEngine(config(tiny_llama_dir))
    engine = AsyncLLMEngine(None, engine=inner)
    outcomes: dict[str, object] = {}

    def read(key: str) -> None:
        try:
            outcomes[key] = engine.load_adapter_files("a", str(tiny_adapters["a"]))
        except BaseException as err:  # noqa: BLE001 - checked below
            outcomes[key] = err

    submitted = threading.Semaphore(0)
    submit = engine._files.submit

    def counted_submit(*args, **kwargs):  # type: ignore[no-untyped-def]
        read = submit(*args, **kwargs)
        submitted.release()
        return read

    engine._files.submit = counted_submit
    running, queued = threading.Thread(target=read, args=("running",)), threading.Thread(target=read, args=("queued",))
    shutdowns = [threading.Thread(target=engine.shutdown, args=(0.05, 0.05) if calls == "one call" else (600.0, 600.0), daemon=True)]
    try:
        running.start()
        assert inner.reading.wait(30)
        queued.start()
        assert submitted.acquire(timeout=30) and submitted.acquire(timeout=30)  # the second read is queued behind the first
        with caplog.at_level(logging.WARNING, logger="runtime.async_engine"):
            shutdowns[0].start()
            if calls != "one call":
                for _ in range(3000):  # until the first call's teardown waits for the read (the step thread has ended)
                    if not engine.running:
                        break
                    time.sleep(0.01)
                shutdowns.append(threading.Thread(target=engine.shutdown, args=(0.0, 0.0), daemon=True))
                shutdowns[1].start()
            for call in shutdowns:
                call.join(30)
            assert not any(call.is_alive() for call in shutdowns), "shutdown() waited for the stuck file read"
        left = [r.getMessage() for r in caplog.records if "adapter file read" in r.getMessage()]
        assert len(left) == 1 and "adapter 'a' from" in left[0] and "(running)" in left[0] and "(queued)" in left[0], left
        assert not engine.step_abandoned and not engine.running and engine.dead_error == "engine was shut down"
        running.join(30)  # the read is still stuck: its caller no longer waits for it
        queued.join(30)
        assert not running.is_alive() and not queued.is_alive(), "a caller still waits for the stuck read"
        for key in ("running", "queued"):
            assert isinstance(outcomes[key], EngineDeadError) and "before the read of adapter 'a' from" in str(outcomes[key]), outcomes
    finally:
        inner.read_gate.set()
        running.join(30)
        queued.join(30)
    with pytest.raises(EngineDeadError):
        engine.load_adapter_files("a", str(tiny_adapters["a"]))


def test_shutdown_does_not_wait_past_its_deadline_for_a_stuck_adapter_pool_read(tiny_llama_dir: Path, tiny_adapters, caplog) -> None:
    """The adapter pool re-reads from disk an adapter that left the host tier when a request needs
    it. Shutdown's last act, ``engine.close()``, shut the pool's loader down with
    ``ThreadPoolExecutor.shutdown(wait=True)``: a read stuck on a network mount held shutdown (and
    a server's exit) for ever. Now it is waited for until shutdown's deadline, then left to its
    daemon thread with a WARNING naming it; the engine is closed (its model released) all the same."""
    import logging

    inner = HeldLoadEngine(config(tiny_llama_dir, max_cpu_loras=2))
    engine = AsyncLLMEngine(None, engine=inner)
    outputs: list[RequestOutput] = []

    async def consume() -> None:
        async for out in engine.generate("needs-a", [5, 6], greedy(2), "a"):
            outputs.append(out)

    consumer = threading.Thread(target=asyncio.run, args=(consume(),))
    shutdown = threading.Thread(target=engine.shutdown, args=(0.05, 0.05), daemon=True)
    try:
        for name in ("a", "b", "c"):  # a host tier of 2: "a" leaves it, so its request reads it from disk again
            engine.register_adapter(name, str(tiny_adapters["a"]))
        assert "a" not in [ref.name for ref in inner.pool.host_refs()]
        consumer.start()
        assert inner.loading.wait(30)
        with caplog.at_level(logging.WARNING, logger="runtime.engine"):
            shutdown.start()
            shutdown.join(30)
            assert not shutdown.is_alive(), "shutdown() waited for the stuck adapter pool read"
        consumer.join(30)
        assert not consumer.is_alive() and outputs[-1].finish_reason == "error" and outputs[-1].error_kind == "shutdown", outputs
        left = [r.getMessage() for r in caplog.records if "adapter read(s) from disk" in r.getMessage()]
        assert len(left) == 1 and "adapter 'a' (version" in left[0] and "(running)" in left[0], left
        assert engine.dead_error == "engine was shut down" and not engine.step_abandoned
        assert inner.runner.model is None  # closed: the model is released although the read goes on
    finally:
        inner.load_gate.set()
        consumer.join(30)
        shutdown.join(30)


class _SnapshotHungAfterFailAll(LLMEngine):
    """Shutdown's ``fail_all`` waits for ``proceed`` (``failing``: it began); a snapshot taken once
    it began hangs until ``snapshot_gate`` (a hung device), ``snapshotting``: it did."""

    def __init__(self, config: EngineConfig) -> None:
        self.failing, self.proceed = threading.Event(), threading.Event()
        self.snapshotting, self.snapshot_gate = threading.Event(), threading.Event()
        super().__init__(config)

    def fail_all(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.failing.set()
        self.proceed.wait(30)
        return super().fail_all(*args, **kwargs)

    def snapshot(self):  # type: ignore[no-untyped-def]
        if self.failing.is_set():
            self.snapshotting.set()
            self.snapshot_gate.wait(60)
        return super().snapshot()


def test_shutdown_gives_up_on_a_lock_holder_that_took_the_lock_after_the_requests_were_failed(tiny_llama_dir: Path, caplog) -> None:
    """After failing the requests, shutdown joined the step thread for max(1, drain) s, not until
    its own deadline (nor a later call's), then waited for the helper threads' tasks without any
    bound (``_submit.shutdown(wait=True)``): a snapshot that took the engine lock just after the
    requests were failed and hung (a hung device) held the step thread and an abort queued behind
    it, so shutdown, even a second call with no time at all, waited for it (here: 600 s). Now both
    are waited for until the deadline of the calls under way; then the holder is given up on, as
    one found holding the lock when the grace ends: an ERROR names it, those waiting behind it get
    an EngineDeadError, and the engine is not closed."""
    import logging

    inner = _SnapshotHungAfterFailAll(config(tiny_llama_dir))
    engine = AsyncLLMEngine(None, engine=inner)

    def queued_for_the_lock(count: int) -> bool:
        for _ in range(3000):
            with engine._lock._mutex:
                if len(engine._lock._waiters) >= count:
                    return True
            time.sleep(0.01)
        return False

    first = threading.Thread(target=engine.shutdown, args=(600.0, 600.0), daemon=True)
    snapshot = threading.Thread(target=engine.snapshot, daemon=True)
    second = threading.Thread(target=engine.shutdown, args=(0.0, 0.0), daemon=True)
    try:
        with caplog.at_level(logging.ERROR, logger="runtime.async_engine"):
            first.start()
            assert inner.failing.wait(30)  # shutdown holds the lock to fail the requests
            snapshot.start()
            assert queued_for_the_lock(1)
            abort = engine._off_loop(engine.abort, "no-such-request")  # a helper task, queued behind the snapshot
            assert queued_for_the_lock(2)
            inner.proceed.set()
            assert inner.snapshotting.wait(30)  # the snapshot took the lock after the requests were failed, and hangs
            second.start()
            second.join(30)
            first.join(30)
            assert not second.is_alive() and not first.is_alive(), "shutdown waited for the hung snapshot"
        assert engine.step_abandoned and engine.abandoned_holder == "a snapshot"
        assert any("a snapshot still held the engine lock" in r.getMessage() for r in caplog.records), caplog.records
        with pytest.raises(EngineDeadError):
            abort.result(30)
        engine._thread.join(30)
        assert not engine.running
        assert inner.runner.model is not None  # not closed: the snapshot may still use it
    finally:
        inner.proceed.set()
        inner.snapshot_gate.set()
        for thread in (first, snapshot, second):
            thread.join(30)


STUCK_READ_SCRIPT = """
import asyncio, sys, threading
from concurrent.futures import ThreadPoolExecutor
from runtime.async_engine import AsyncLLMEngine
from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.request import SamplingParams

class StuckReadEngine(LLMEngine):
    reading, loading = threading.Event(), threading.Event()

    def load_adapter_files(self, name, *args, **kwargs):
        if name != "a":
            return super().load_adapter_files(name, *args, **kwargs)
        self.reading.set()
        threading.Event().wait()  # a read stuck on a hung network mount, for good

    def _load_registered(self, ref):  # the adapter pool's read of an adapter that left the host tier
        self.loading.set()
        threading.Event().wait()

async def consume(engine):
    async for out in engine.generate("r", [5, 6], SamplingParams(max_tokens=2), "b"):
        pass
    print("request:", out.error_kind, flush=True)

model, adapter = sys.argv[1], sys.argv[2]
inner = StuckReadEngine(EngineConfig(model=model, device="cpu", dtype="float32", max_loras=2, max_lora_rank=16, max_cpu_loras=2,
                                     max_num_seqs=4, max_model_len=96, block_size=8, num_kv_blocks=64, max_num_batched_tokens=64))
engine = AsyncLLMEngine(None, engine=inner)
for name in ("b", "c", "d"):  # a host tier of 2: "b" leaves it
    engine.register_adapter(name, adapter)
request = threading.Thread(target=asyncio.run, args=(consume(engine),))
request.start()
inner.loading.wait(60)
admin = ThreadPoolExecutor(max_workers=1)  # as the admin route's worker, which waits for the read
load = admin.submit(engine.register_adapter, "a", adapter)
inner.reading.wait(60)
engine.shutdown(0.05, 0.05)
print("shut down:", type(load.exception(timeout=60)).__name__, flush=True)
"""


def test_a_process_whose_adapter_file_read_is_stuck_exits_after_shutdown(tiny_llama_dir: Path, tiny_adapters) -> None:
    """The file reader was a ThreadPoolExecutor's thread, which the interpreter joins at exit, as it
    does the admin route's worker waiting for the read: a process (`lorafleet serve`) whose adapter
    read was stuck on a network mount never exited, even once shutdown() had returned. The reader
    is a daemon thread now, and shutdown gives up on the read, so the waiting caller gets an error.
    So was the adapter pool's loader (a request's adapter read again from disk), whose stuck read
    held shutdown itself (``engine.close()``); it is a daemon thread too, given up on the same way."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    try:
        done = subprocess.run([sys.executable, "-c", STUCK_READ_SCRIPT, str(tiny_llama_dir), str(tiny_adapters["a"])],
                              cwd=repo, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the process did not exit: {err.stdout!r}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "shut down: EngineDeadError" in done.stdout and "request: shutdown" in done.stdout, (done.stdout, done.stderr[-2000:])


def test_llm_close_from_another_thread_waits_for_generate(tiny_llama_dir: Path) -> None:
    from runtime.llm import LLM

    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=96, num_kv_blocks=64, block_size=8)
    results: dict[str, object] = {}
    started = threading.Event()
    real_step = llm.engine.step

    def step(*args, **kwargs):  # type: ignore[no-untyped-def]
        started.set()
        return real_step(*args, **kwargs)

    llm.engine.step = step

    def run() -> None:
        try:
            results["out"] = llm.generate([[5, 6, 7]] * 4, greedy(20))
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            results["err"] = err

    worker = threading.Thread(target=run)
    worker.start()
    assert started.wait(30)
    llm.close()  # waits for the generate call: the engine is not pulled from under it
    worker.join(30)
    assert "err" not in results, results.get("err")
    assert [len(r.token_ids) for r in results["out"]] == [20] * 4
    with pytest.raises(Exception, match="released|closed"):
        llm.generate("hello", greedy(1))


def test_close_from_two_threads_tears_down_once_and_both_return_after_the_teardown(tiny_llama_dir: Path) -> None:
    """LLMEngine.close() had no lock: a second call made while the first was tearing down saw
    ``_closed`` set and returned at once, before the model was released (and two calls made at the
    same moment could both tear down). Now the second waits for the first's teardown."""
    engine = LLMEngine(config(tiny_llama_dir))
    tearing_down, go = threading.Event(), threading.Event()
    events: list[str] = []
    pool_close, runner_release = engine.pool.close, engine.runner.release

    def blocking_pool_close(timeout: float | None = None) -> list[str]:
        events.append("teardown began")
        tearing_down.set()
        go.wait(30)
        return pool_close(timeout)

    def recorded_release() -> None:
        runner_release()
        events.append("teardown done")

    engine.pool.close, engine.runner.release = blocking_pool_close, recorded_release

    def close(name: str) -> None:
        engine.close()
        events.append(f"{name} returned")

    first = threading.Thread(target=close, args=("first",))
    second = threading.Thread(target=close, args=("second",))
    first.start()
    assert tearing_down.wait(30)
    second.start()
    second.join(0.5)  # the old close() returned by now, the teardown still blocked
    go.set()
    first.join(30)
    second.join(30)
    assert not first.is_alive() and not second.is_alive()
    assert events.count("teardown began") == 1 and events.count("teardown done") == 1, events
    assert events.index("second returned") > events.index("teardown done"), events


def test_llm_after_a_failed_step_serves_the_next_call_cleanly(tiny_llama_dir: Path) -> None:
    """A step fails after finishing one of the call's requests: the call raises, and the next
    call gets exactly its own results (the finished request's kept output must not leak into it)."""
    from runtime.llm import LLM

    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=96, num_kv_blocks=64, block_size=8)
    engine = llm.engine
    finished: list[str] = []
    engine.add_observer(lambda m: finished.append(m.request_id))
    real_prefetch = engine.pool.prefetch

    def prefetch(refs):  # type: ignore[no-untyped-def]
        if finished:
            engine.pool.prefetch = real_prefetch
            raise RuntimeError("injected: a device copy failed")
        return real_prefetch(refs)

    engine.pool.prefetch = prefetch
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[5, 6, 7], [5, 6, 7]], [greedy(2), greedy(30)])
    assert not engine.has_unfinished()
    again = llm.generate([[8, 9], [8, 9, 10]], greedy(3))
    assert [len(r.token_ids) for r in again] == [3, 3] and [r.prompt_token_ids for r in again] == [(8, 9), (8, 9, 10)]
    llm.close()


def test_an_admission_group_is_admitted_as_one_across_a_hot_reload(tiny_llama_dir: Path, tiny_adapters) -> None:
    """The requests of one group (one HTTP request's prompts and n choices) are admitted in one
    hold of the engine lock, once all have arrived: a hot reload cannot fall between them, so
    they run on one adapter version. Here the reload lands while the first waits for the second:
    both then run on the new version (alone, the first would have bound to the old one)."""
    engine = AsyncLLMEngine(config(tiny_llama_dir))
    try:
        old = engine.register_adapter("x", str(tiny_adapters["a"]))

        async def run() -> list[RequestOutput]:
            group = engine.admission_group(2)
            first = asyncio.ensure_future(_final(engine.generate("g-0", [5, 6, 7], greedy(3), "x", group=group)))
            await asyncio.sleep(0.3)  # the first is parked, not admitted
            assert engine.snapshot()["running"] + engine.snapshot()["waiting"] == 0
            new = await asyncio.to_thread(engine.register_adapter, "x", str(tiny_adapters["b"]))
            assert new.version != old.version
            second = await _final(engine.generate("g-1", [5, 6, 8], greedy(3), "x", group=group))
            return [await first, second]

        outs = asyncio.run(run())
        assert [o.adapter.version for o in outs] == [engine.adapters()[0].version] * 2
        with pytest.raises(ValueError, match="size must be an integer >= 1"):
            engine.admission_group(0)
    finally:
        engine.shutdown()


def test_a_group_still_waiting_for_members_fails_at_shutdown(tiny_llama_dir: Path) -> None:
    """A parked request (its group never filled) gets EngineDeadError when the engine shuts
    down, rather than waiting forever; a group started after shutdown is refused at once."""
    engine = AsyncLLMEngine(config(tiny_llama_dir))

    async def run() -> None:
        parked = asyncio.ensure_future(_final(engine.generate("p-0", [5, 6], greedy(2), group=engine.admission_group(2))))
        await asyncio.sleep(0.1)
        await asyncio.to_thread(engine.shutdown, 5.0)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await asyncio.wait_for(parked, 5)
        with pytest.raises(EngineDeadError):
            await _final(engine.generate("late", [5, 6], greedy(2), group=engine.admission_group(2)))

    asyncio.run(run())


async def _final(stream) -> RequestOutput:  # type: ignore[no-untyped-def]
    out = None
    async for out in stream:
        pass
    return out


def test_a_group_naming_one_request_id_twice_is_refused_whole(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine(config(tiny_llama_dir))
    try:
        async def run() -> list[object]:
            group = engine.admission_group(3)
            streams = [_final(engine.generate(rid, [5, 6, 7], greedy(2), group=group)) for rid in ("x", "y", "x")]
            return await asyncio.gather(*streams, return_exceptions=True)

        outcomes = asyncio.run(run())
        assert [type(o).__name__ for o in outcomes] == ["GroupRefused", "GroupRefused", "ValueError"], outcomes
        assert "appears twice" in str(outcomes[2])
        assert engine.snapshot()["running"] + engine.snapshot()["waiting"] == 0
    finally:
        engine.shutdown()


def test_add_checked_refuses_an_adapter_unregistered_since_the_check(tiny_llama_dir: Path, tiny_adapters) -> None:
    from runtime.request import UnknownAdapterError

    engine = LLMEngine(config(tiny_llama_dir))
    engine.register_adapter("x", str(tiny_adapters["a"]))
    checked = engine.check_request("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=1.0), "x")
    engine.unregister_adapter("x")
    with pytest.raises(UnknownAdapterError, match="no longer registered"):
        engine.add_checked(checked)
    assert not engine.has_unfinished()
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=1.0, seed=3))  # the id is free: nothing was left behind
    assert len(run_to_completion(engine)["r"].token_ids) == 2


def test_a_built_engine_with_another_config_or_a_backend_is_refused(tiny_llama_dir) -> None:
    """engine= brings its own config and backend: another config beside it was ignored silently."""
    import pytest

    from runtime.async_engine import AsyncLLMEngine
    from tests.engine_helpers import make_engine

    built = make_engine(tiny_llama_dir)
    with pytest.raises(ValueError, match="engine= brings its own config"):
        AsyncLLMEngine(built.config.replace(max_num_seqs=built.config.max_num_seqs + 1), engine=built)
    with pytest.raises(ValueError, match="engine= brings its own config"):
        AsyncLLMEngine(None, backend=object(), engine=built)
    with pytest.raises(ValueError, match="give a config"):
        AsyncLLMEngine(None)


def test_a_waiter_interrupted_in_the_engine_lock_does_not_take_it_with_it() -> None:
    """Ctrl-C while the main thread waited for the engine lock (snapshot() during a step) left its
    turn queued: the next release handed the lock to nobody, and every later caller, the step
    thread and shutdown() included, waited for ever."""
    import signal

    from runtime.fair_lock import FairLock

    lock = FairLock()
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)

    def interrupt(signum, frame):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            lock.acquire()  # waits for the holder; the timer interrupts it
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    release.set()
    thread.join(10)
    assert lock.acquire(timeout=5), "the lock went to the interrupted waiter"
    lock.release()


def test_the_holder_of_an_abandoned_engine_lock_can_still_notify_and_release() -> None:
    """abandon() left the holder's release working but not its Condition's notify (threading.Condition
    checks ownership with a non-blocking acquire, which raised EngineDeadError): a holder that was
    handed the lock as shutdown gave up on a step (an abort, which notifies the step thread) failed
    with it. Waiters and later callers are still refused."""
    from runtime.fair_lock import FairLock

    lock = FairLock()
    wake = threading.Condition(lock)
    lock.acquire()
    lock.abandon(lambda: EngineDeadError("gave up"))
    wake.notify_all()
    lock.release()
    with pytest.raises(EngineDeadError, match="gave up"):
        lock.acquire(blocking=False)
    with pytest.raises(RuntimeError, match="cannot notify on un-acquired lock"):
        wake.notify_all()  # not held: still refused, as before


def test_a_condition_wait_that_cannot_retake_an_abandoned_lock_leaves_the_holder_s_hold() -> None:
    """A thread woken in Condition.wait re-takes the lock; abandoned meanwhile, that raised, and the
    release of the waiter's ``with`` block on the way out then released a lock it did not hold: it
    cleared the hold of the thread that had it (whose own release then raised "unheld"), or raised."""
    from runtime.fair_lock import FairLock

    lock = FairLock()
    wake = threading.Condition(lock)
    waiting = threading.Event()
    ended: list[BaseException] = []

    def waiter() -> None:  # the idle step thread: ``with lock: wake.wait()``
        try:
            with lock:
                waiting.set()
                wake.wait()
        except BaseException as err:  # noqa: BLE001 - checked below
            ended.append(err)

    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiting.wait(10)
    lock.acquire()  # the waiter's wait() has released it: it is ours (an abort, say)
    wake.notify_all()  # the waiter wakes and queues for the lock we hold
    lock.abandon(lambda: EngineDeadError("gave up"))  # shutdown gives up: the waiter's re-take raises
    thread.join(10)
    assert not thread.is_alive()
    assert len(ended) == 1 and isinstance(ended[0], EngineDeadError), ended
    lock.release()  # still ours to release
    with pytest.raises(RuntimeError, match="unheld"):
        lock.release()


def test_an_idle_step_thread_woken_after_shutdown_gave_up_on_the_lock_does_not_release_it(tiny_llama_dir: Path, caplog) -> None:
    """The same at the engine: the idle step thread waits in ``self._wake.wait()``; a thread that held
    the engine lock past the shutdown's grace (here the test) notifies it (an abort does), and the
    step thread's ``with self._lock`` exit released the lock the other thread held. The step thread
    then ends quietly: it logged "engine step abandoned at shutdown ended with EngineDeadError",
    though no step had run."""
    import logging

    engine = AsyncLLMEngine(config(tiny_llama_dir))
    for _ in range(1000):  # until the step thread waits for work (it gets there at once)
        with engine._lock:
            if engine._wake._waiters:
                break
        time.sleep(0.01)
    else:
        pytest.fail("the step thread never waited for work")
    engine._lock.acquire()
    engine.shutdown(timeout=0, step_grace_s=0)  # the lock is ours: shutdown gives up on it
    assert engine.step_abandoned
    with caplog.at_level(logging.ERROR, logger="runtime.async_engine"):
        engine._wake.notify_all()
        engine._thread.join(30)
    assert not engine.running
    assert not any("engine step abandoned" in r.getMessage() for r in caplog.records), caplog.text
    engine._lock.release()  # ours; the step thread's exit had released it in our place
    engine.engine.close()


def stuck_engine_and_consumer(tiny_llama_dir: Path, max_tokens: int) -> tuple[StuckStepEngine, AsyncLLMEngine, list[RequestOutput], threading.Thread]:
    """An engine whose step blocks (``StuckStepEngine``: ``entered`` once in the step,
    ``unstuck`` releases it) and a consumer thread, not started, streaming one request's outputs
    into the list returned."""
    inner = StuckStepEngine(config(tiny_llama_dir))
    engine = AsyncLLMEngine(None, engine=inner)
    outputs: list[RequestOutput] = []

    async def consume() -> None:
        async for out in engine.generate("stuck", [5, 6, 7], greedy(max_tokens)):
            outputs.append(out)

    return inner, engine, outputs, threading.Thread(target=asyncio.run, args=(consume(),))


def test_a_shutdown_called_while_another_gives_up_on_a_stuck_step_returns(tiny_llama_dir: Path, monkeypatch) -> None:
    """A second shutdown() (a second signal, a replica's cleanup) made while the first was waiting
    for a stuck step waited for the engine lock too; when the first gave up on the step, the
    abandoned lock made the second raise EngineDeadError instead of returning."""
    inner, engine, _, consumer = stuck_engine_and_consumer(tiny_llama_dir, 4)
    abandoning, go = threading.Event(), threading.Event()
    abandon_step = engine._abandon_holder

    def gated_abandon_step(*args) -> None:  # type: ignore[no-untyped-def]
        abandoning.set()
        go.wait(30)  # until the second call is under way
        abandon_step(*args)

    monkeypatch.setattr(engine, "_abandon_holder", gated_abandon_step)
    errors: list[BaseException] = []

    def call_shutdown(called: threading.Event, timeout: float) -> None:
        called.set()
        try:
            engine.shutdown(timeout, timeout)
        except BaseException as err:  # noqa: BLE001 - checked below
            errors.append(err)

    try:
        consumer.start()
        assert inner.entered.wait(30)
        first = threading.Thread(target=call_shutdown, args=(threading.Event(), 0.05))
        first.start()
        assert abandoning.wait(30)  # the first gives up on the step, held before it abandons the lock
        second_called = threading.Event()
        second = threading.Thread(target=call_shutdown, args=(second_called, 60.0))
        second.start()
        assert second_called.wait(30)
        second.join(0.5)  # lets it reach its wait (for the engine lock before, for the first call now)
        go.set()
        first.join(30)
        second.join(30)
        assert not first.is_alive() and not second.is_alive()
        assert errors == [], errors
        assert engine.step_abandoned
        engine.shutdown(60.0, 60.0)  # later: returns at once
    finally:
        go.set()
        inner.unstuck.set()
        engine._thread.join(30)
        consumer.join(30)
    inner.close()


def test_a_shutdown_called_again_from_the_thread_running_one_returns(tiny_llama_dir: Path, monkeypatch) -> None:
    """A shutdown() made from the thread already running one, as a signal handler does (a SIGTERM
    handler that shuts the engine down, run while the main thread is in shutdown), waited for the
    lock the call it interrupted holds, for ever. It returns at once: the interrupted call finishes
    the work once the handler returns."""
    engine = AsyncLLMEngine(config(tiny_llama_dir))
    fail_parked = engine._fail_parked
    nested: list[str] = []

    def fail_parked_then_reenter(why: str) -> None:  # inside the running shutdown, where a handler would interrupt it
        fail_parked(why)
        engine.shutdown(timeout=5.0)
        nested.append("returned")

    monkeypatch.setattr(engine, "_fail_parked", fail_parked_then_reenter)
    outer = threading.Thread(target=engine.shutdown, kwargs={"timeout": 5.0}, daemon=True)
    outer.start()
    outer.join(60)
    assert not outer.is_alive(), "the nested shutdown() waited for the call it interrupted"
    assert nested == ["returned"] and not engine.running and engine.dead_error == "engine was shut down"
    engine.shutdown()  # later: returns at once


def test_a_concurrent_shutdown_gives_up_on_a_stuck_step_by_its_own_deadline(tiny_llama_dir: Path) -> None:
    """A second shutdown() made while another was waiting for a stuck step waited for that one's
    (far longer) timeout, ignoring its own. Now it holds the running call to its own deadlines:
    the stuck step is given up on ``timeout + step_grace_s`` after the second call, and both return."""
    inner, engine, outputs, consumer = stuck_engine_and_consumer(tiny_llama_dir, 4)
    first = threading.Thread(target=engine.shutdown, args=(600.0, 600.0), daemon=True)
    second = threading.Thread(target=engine.shutdown, args=(0.05, 0.05), daemon=True)
    try:
        consumer.start()
        assert inner.entered.wait(30)
        first.start()
        second.start()
        second.join(30)
        assert not second.is_alive(), "the second shutdown() waited for the first one's timeout"
        first.join(30)
        assert not first.is_alive()
        assert engine.step_abandoned and engine.abandoned_holder == "a step"
        consumer.join(30)
        (end,) = outputs
        assert end.finish_reason == "error" and end.error_kind == "shutdown" and "a step was still running" in (end.error or ""), end
    finally:
        inner.unstuck.set()
        engine._thread.join(30)
        consumer.join(30)
    inner.close()


def test_a_concurrent_shutdown_ends_the_drain_by_its_own_timeout(tiny_llama_dir: Path) -> None:
    """The same for the drain: a second shutdown(timeout=0) made while the first let the requests
    in flight run for up to 600 s ended nothing; now the drain ends then, the request in flight
    gets the "shutdown" error once its step returns, and the engine is closed as usual."""
    inner, engine, outputs, consumer = stuck_engine_and_consumer(tiny_llama_dir, 80)
    first = threading.Thread(target=engine.shutdown, args=(600.0, 600.0), daemon=True)
    second = threading.Thread(target=engine.shutdown, args=(0.0, 600.0), daemon=True)
    try:
        consumer.start()
        assert inner.entered.wait(30)
        first.start()
        second.start()
        waited_until = time.monotonic() + 30
        while len(getattr(engine, "_shutdown_ends", ())) < 2 and time.monotonic() < waited_until:
            time.sleep(0.01)  # until both calls are under way (the second's deadline counts), waiting for the step
        inner.unstuck.set()  # the step returns (and the next ones at once): 80 tokens take a while longer
        second.join(30)
        first.join(30)
        assert not second.is_alive() and not first.is_alive(), "a shutdown() still waits for the first one's drain"
        consumer.join(30)
        end = outputs[-1]
        assert end.finish_reason == "error" and end.error_kind == "shutdown", end
        assert not engine.step_abandoned and not engine.running and engine.dead_error == "engine was shut down"
    finally:
        inner.unstuck.set()
        engine._thread.join(30)
        consumer.join(30)


def test_shutdown_names_a_hung_snapshot_as_what_it_gave_up_on(tiny_llama_dir: Path, caplog) -> None:
    """Whatever held the engine lock at the grace's end, the ERROR line, the engine's dead error and
    the streams said "a step" was still running; a hung snapshot (a /metrics read) is named now."""
    import logging

    inner = LLMEngine(config(tiny_llama_dir))
    engine = AsyncLLMEngine(None, engine=inner)
    holding, go = threading.Event(), threading.Event()
    real_snapshot = inner.snapshot

    def hung_snapshot() -> dict:
        holding.set()
        go.wait(30)
        engine._wake.notify_all()  # the holder may still notify: the idle step thread wakes and stops
        return real_snapshot()

    inner.snapshot = hung_snapshot
    snapshot = threading.Thread(target=engine.snapshot)
    try:
        snapshot.start()
        assert holding.wait(30)
        with caplog.at_level(logging.ERROR, logger="runtime.async_engine"):
            engine.shutdown(0.05, 0.05)
        assert any(r.getMessage().startswith("a snapshot still held the engine lock") for r in caplog.records), caplog.text
        assert engine.dead_error == "engine was shut down while a snapshot was still running"
        assert engine.step_abandoned and engine.abandoned_holder == "a snapshot"
    finally:
        go.set()
        snapshot.join(30)
        engine._thread.join(30)
    assert not snapshot.is_alive() and not engine.running
    inner.close()


def test_shutdown_does_not_give_up_on_a_holder_that_let_go_as_the_grace_ended(tiny_llama_dir: Path, caplog) -> None:
    """shutdown read the holder's name, then abandoned the lock whatever happened in between: a
    holder that let go just then (here a hung snapshot, released as abandon() is called) was named
    as stuck, and the engine was declared dead, neither drained nor closed, though the lock was free.
    Now only the very hold seen as the wait ended is given up on; the shutdown goes on as usual."""
    import logging

    inner = LLMEngine(config(tiny_llama_dir))
    engine = AsyncLLMEngine(None, engine=inner)
    holding, go = threading.Event(), threading.Event()
    real_snapshot = inner.snapshot

    def hung_snapshot() -> dict:
        holding.set()
        go.wait(30)
        return real_snapshot()

    inner.snapshot = hung_snapshot
    snapshot = threading.Thread(target=engine.snapshot)
    real_abandon = engine._lock.abandon

    def let_go_then_abandon(*args, **kwargs):  # type: ignore[no-untyped-def]
        go.set()  # the snapshot returns and lets go of the lock, just before it is abandoned
        snapshot.join(30)
        return real_abandon(*args, **kwargs)

    engine._lock.abandon = let_go_then_abandon
    try:
        snapshot.start()
        assert holding.wait(30)
        with caplog.at_level(logging.ERROR, logger="runtime.async_engine"):
            engine.shutdown(0.05, 0.05)
        assert not snapshot.is_alive()
        assert not engine.step_abandoned and engine.abandoned_holder is None
        assert engine.dead_error == "engine was shut down" and not engine.running
        assert not any("still held the engine lock" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        go.set()
        snapshot.join(30)
        if not engine.step_abandoned:  # else its idle step thread waits for ever (a daemon)
            engine._thread.join(30)
        inner.close()


def test_the_engine_lock_is_abandoned_only_by_the_acquisition_that_held_it() -> None:
    """The same at the lock: the hold seen as a timed wait ended, let go of and taken again under the
    same name, is another acquisition; abandoning the first changes nothing."""
    from runtime.fair_lock import FairLock

    lock = FairLock()
    lock.acquire(holder="a snapshot")
    taken, seen = lock.acquire_or_holder(timeout=0, holder="shutdown")
    assert not taken and seen is not None and seen.holder == "a snapshot"
    lock.release()
    lock.acquire(holder="a snapshot")  # another snapshot
    assert not lock.abandon(lambda: EngineDeadError("gave up"), only=seen)
    assert not lock.abandoned and lock.abandoned_holder is None
    lock.release()
    assert lock.acquire(blocking=False), "the lock was abandoned"
    taken, now = lock.acquire_or_holder(timeout=0, holder="shutdown")
    assert not taken and now is not None and now != seen
    assert lock.abandon(lambda: EngineDeadError("gave up"), only=now)
    assert lock.abandoned and lock.abandoned_holder == "a caller"
    lock.release()
    with pytest.raises(EngineDeadError, match="gave up"):
        lock.acquire(blocking=False)


@pytest.mark.parametrize("window", ["after the lock is taken", "before the lock is let go"])
def test_a_shutdown_from_a_signal_handler_in_shutdown_s_lock_window_returns(tiny_llama_dir: Path, window: str) -> None:
    """shutdown() marked its thread as the one shutting down only once it held its lock, and
    cleared the mark before letting go of it: a signal handler calling shutdown() in either window
    waited for the lock its own thread held, for ever. Stood in for by a lock that calls
    shutdown() right after it is taken, or right before it is let go."""
    engine = AsyncLLMEngine(config(tiny_llama_dir))
    nested: list[str] = []

    class LockThatRunsAHandler:
        def __init__(self) -> None:
            self.lock, self.fired = threading.Lock(), False

        def handler(self) -> None:
            if not self.fired:
                self.fired = True
                engine.shutdown(timeout=5.0)
                nested.append("returned")

        def __enter__(self) -> bool:
            self.lock.acquire()
            if window == "after the lock is taken":
                self.handler()
            return True

        def __exit__(self, *exc: object) -> None:
            if window == "before the lock is let go":
                self.handler()
            self.lock.release()

    engine._shutdown_once = LockThatRunsAHandler()
    outer = threading.Thread(target=engine.shutdown, kwargs={"timeout": 5.0}, daemon=True)
    outer.start()
    outer.join(60)
    assert not outer.is_alive(), "the handler's shutdown() waited for the lock its own thread held"
    assert nested == ["returned"] and not engine.running and engine.dead_error == "engine was shut down"


@pytest.mark.parametrize("source", ["creator", "backend"])
def test_the_step_thread_runs_on_the_gpu_the_engine_was_made_for(tiny_llama_dir, monkeypatch, source) -> None:
    """Each thread has its own current GPU and Triton launches on it, not on the tensors' GPU; the
    step thread used to start on GPU 0 whatever the creator had selected (``torch.cuda.set_device(1)``)
    or the backend held (``cuda:1``), and would have launched the kernels there with another GPU's
    pointers. Without a GPU: torch's device calls are stood in and the engine runs on the CPU."""
    import torch

    chosen: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append((threading.current_thread().name, device)))
    engine = LLMEngine(config(tiny_llama_dir))
    if source == "creator":
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
        want: object = 1
    else:
        monkeypatch.setattr(engine.backend, "device", torch.device("cuda:1"))
        want = torch.device("cuda:1")
    async_engine = AsyncLLMEngine(None, engine=engine)
    try:
        assert chosen == [("lorafleet-engine-step", want)]
    finally:
        async_engine.shutdown()


def test_a_cpu_engine_leaves_the_step_threads_gpu_alone(tiny_llama_dir, monkeypatch) -> None:
    import torch

    chosen: list[object] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    async_engine = AsyncLLMEngine(config(tiny_llama_dir))
    async_engine.shutdown()
    assert chosen == []


def test_a_stuck_step_does_not_hold_shutdown_for_ever(tiny_llama_dir: Path, caplog) -> None:
    """shutdown() waited for the engine lock without a bound: a step that never returned held the
    drain (so `lorafleet serve` until a second signal), its streams, and every thread waiting for
    the lock (an admission, a /metrics snapshot). Now, a ``step_grace_s`` after the drain, an ERROR
    line says so, the streams end with a "shutdown" error (a 503), the waiters get EngineDeadError,
    and shutdown returns; should the step ever return, the step thread stops without another."""
    import logging

    inner = StuckStepEngine(config(tiny_llama_dir))
    engine = AsyncLLMEngine(None, engine=inner)
    outputs: list[RequestOutput] = []

    async def consume(request_id: str) -> None:
        async for out in engine.generate(request_id, [5, 6, 7], greedy(4)):
            outputs.append(out)

    async def scenario() -> None:
        stuck = asyncio.create_task(consume("stuck"))
        assert await asyncio.to_thread(inner.entered.wait, 30)
        snapshot = asyncio.create_task(asyncio.to_thread(engine.snapshot))  # waits for the lock the step holds
        late = asyncio.create_task(consume("late"))  # queued for admission, which waits for the lock too
        await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.to_thread(engine.shutdown, 0.05, 0.05), 30)
        await asyncio.wait_for(stuck, 30)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(snapshot, 30)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(late, 30)

    try:
        with caplog.at_level(logging.ERROR, logger="runtime.async_engine"):
            asyncio.run(scenario())
        assert engine.step_abandoned and not engine.accepting
        (end,) = outputs
        assert end.request_id == "stuck" and end.finish_reason == "error" and end.error_kind == "shutdown", end
        assert "a step was still running" in (end.error or "")
        assert any("a step still held the engine lock" in r.getMessage() and "not waiting for it" in r.getMessage() for r in caplog.records), caplog.text
        with pytest.raises(EngineDeadError):
            engine.abort("stuck")
        engine.shutdown(0.05, 0.05)  # again (a second signal, a caller's cleanup): nothing left to do
    finally:
        inner.unstuck.set()  # the step returns: the step thread stops before another
        engine._thread.join(30)
    assert not engine.running
    inner.close()
