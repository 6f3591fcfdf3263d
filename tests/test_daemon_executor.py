"""DaemonExecutor: a thread pool of daemon threads, which a stuck piece of work cannot hold at exit."""
from __future__ import annotations

import gc
import subprocess
import sys
import threading
from concurrent.futures import BrokenExecutor, CancelledError
from pathlib import Path

import pytest

from runtime.daemon_executor import DaemonExecutor


def test_work_runs_in_daemon_threads_started_as_needed_up_to_max_workers() -> None:
    initialized: list[str] = []
    executor = DaemonExecutor(2, "test-daemon", initializer=lambda: initialized.append(threading.current_thread().name))
    release = threading.Event()
    try:
        held = [executor.submit(release.wait, 30) for _ in range(3)]  # two run, one waits for a thread
        failing = executor.submit(lambda: 1 / 0)
        ran_in = executor.submit(lambda: (threading.current_thread().name, threading.current_thread().daemon))
        release.set()
        assert [f.result(30) for f in held] == [True] * 3
        with pytest.raises(ZeroDivisionError):
            failing.result(30)
        name, daemon = ran_in.result(30)
        assert daemon and name.startswith("test-daemon_")
        assert sorted(initialized) == ["test-daemon_0", "test-daemon_1"]  # two threads, each initialized once
    finally:
        executor.shutdown()


def test_shutdown_refuses_new_work_cancels_the_queued_if_asked_and_lets_the_threads_end() -> None:
    executor = DaemonExecutor(1, "test-daemon")
    started, release = threading.Event(), threading.Event()
    running = executor.submit(lambda: (started.set(), release.wait(30))[1])
    queued = executor.submit(lambda: "ran")
    assert started.wait(30)
    executor.shutdown(wait=False, cancel_futures=True)
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(lambda: None)
    with pytest.raises(CancelledError):
        queued.result(0)
    release.set()
    assert running.result(30) is True
    executor.shutdown(wait=True)  # joins the thread, which ends now that its work has
    assert not any(t.name.startswith("test-daemon_") and t.is_alive() for t in executor._threads)


def test_a_thread_whose_initializer_failed_fails_its_work_with_broken_executor() -> None:
    executor = DaemonExecutor(1, "test-daemon", initializer=lambda: 1 / 0)
    with pytest.raises(BrokenExecutor, match="initializer failed: ZeroDivisionError"):
        executor.submit(lambda: "never").result(30)
    executor.shutdown()


def test_the_threads_of_a_collected_executor_end() -> None:
    executor = DaemonExecutor(1, "test-daemon")
    assert executor.submit(lambda: 1).result(30) == 1
    thread = executor._threads[0]
    del executor
    gc.collect()
    thread.join(30)
    assert not thread.is_alive()


STUCK_WORK_SCRIPT = """
import threading
from runtime.daemon_executor import DaemonExecutor
executor = DaemonExecutor(1, "stuck")
holding = threading.Event()
executor.submit(lambda: (holding.set(), threading.Event().wait()))
assert holding.wait(30)
print("leaving", flush=True)
"""


def test_a_process_whose_work_is_stuck_still_exits() -> None:
    """A ``ThreadPoolExecutor`` here never exits: the interpreter joins its thread."""
    repo = Path(__file__).resolve().parents[1]
    try:
        done = subprocess.run([sys.executable, "-c", STUCK_WORK_SCRIPT], cwd=repo, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the process did not exit: {err.stdout!r}")
    assert done.returncode == 0 and "leaving" in done.stdout, done.stderr[-2000:]
