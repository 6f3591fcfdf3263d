"""FairLock.acquire_or_holder(until=...): a deadline-bounded wait that keeps its place in the queue."""
from __future__ import annotations

import threading
import time

import pytest

from runtime.fair_lock import FairLock

POLL_S = 0.005  # how often the waits below read their deadline again


def queued(lock: FairLock, count: int) -> bool:
    for _ in range(3000):
        with lock._mutex:
            if len(lock._waiters) >= count:
                return True
        time.sleep(0.001)
    return False


def test_a_deadline_bounded_wait_keeps_its_place_ahead_of_later_waiters() -> None:
    """Polled with plain ``acquire(timeout=POLL_S)`` calls, the first waiter left the queue after
    each poll and joined it again behind the later one, which got the lock first."""
    lock = FairLock()
    lock.acquire(holder="a step")
    order: list[str] = []

    def take(name: str, **kwargs) -> None:  # type: ignore[no-untyped-def]
        taken, _ = lock.acquire_or_holder(holder=name, **kwargs)
        order.append(name if taken else f"{name} timed out")
        if taken:
            lock.release()

    deadline = time.monotonic() + 60
    first = threading.Thread(target=take, args=("shutdown",), kwargs={"timeout": POLL_S, "until": lambda: deadline})
    first.start()
    assert queued(lock, 1)
    later = threading.Thread(target=take, args=("a snapshot",))
    later.start()
    assert queued(lock, 2)
    time.sleep(20 * POLL_S)  # the first waiter read its deadline again many times meanwhile
    lock.release()
    first.join(30)
    later.join(30)
    assert order == ["shutdown", "a snapshot"]


def test_a_deadline_bounded_wait_ends_when_the_deadline_it_reads_passes() -> None:
    """The deadline is read again every ``timeout`` s, so one brought forward meanwhile ends the
    wait: it leaves the queue and names the holder."""
    lock = FairLock()
    lock.acquire(holder="a step")
    ends = [time.monotonic() + 60]
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(lock.acquire_or_holder(timeout=POLL_S, holder="shutdown", until=lambda: ends[0])))
    waiter.start()
    assert queued(lock, 1)
    ends[0] = time.monotonic()  # a later shutdown call with no time left
    waiter.join(30)
    taken, holding = result[0]
    assert not taken and holding is not None and holding.holder == "a step"
    assert not lock._waiters
    lock.release()
    assert lock.acquire(blocking=False)


def test_a_deadline_bounded_wait_needs_a_positive_poll() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        FairLock().acquire_or_holder(timeout=-1, until=lambda: 0.0)
