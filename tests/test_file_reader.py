"""FileReader: reads run one at a time and in order in a daemon thread; give_up frees their callers."""
from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from runtime.file_reader import FileReader


def test_reads_run_in_order_and_hand_back_their_outcome() -> None:
    reader = FileReader("test-reader")
    ran: list[int] = []
    first = reader.submit("one", ran.append, 1)
    failing = reader.submit("two", lambda: 1 / 0)
    last = reader.submit("three", ran.append, 3)
    assert first.result(30) is None and last.result(30) is None and ran == [1, 3]
    with pytest.raises(ZeroDivisionError):
        failing.result(30)
    assert reader.pending() == [] and reader._thread.daemon
    reader.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        reader.submit("four", ran.append, 4)
    reader._thread.join(30)
    assert not reader._thread.is_alive()


def test_give_up_frees_the_callers_of_a_stuck_read_and_of_those_queued_behind_it() -> None:
    reader = FileReader("test-reader")
    reading, stuck = threading.Event(), threading.Event()
    ran: list[str] = []

    def stuck_read() -> str:
        reading.set()
        stuck.wait(30)
        ran.append("stuck")
        return "late"

    running = reader.submit("a stuck one", stuck_read)
    cancelled = reader.submit("a cancelled one", ran.append, "cancelled")
    queued = reader.submit("a queued one", ran.append, "queued")
    assert reading.wait(30)
    assert cancelled.cancel()  # its caller went away while it was queued
    left = reader.give_up(lambda what: RuntimeError(f"gave up on {what}"))
    assert left == ["a stuck one (running)", "a queued one (queued)"]
    for future, what in ((running, "a stuck one"), (queued, "a queued one")):
        with pytest.raises(RuntimeError, match=f"gave up on {what}"):
            future.result(0)
    with pytest.raises(CancelledError):
        cancelled.result(0)
    reader.shutdown()
    stuck.set()  # the stuck read ends: its outcome is dropped, and nothing queued behind it runs
    reader._thread.join(30)
    assert ran == ["stuck"] and reader.pending() == []
