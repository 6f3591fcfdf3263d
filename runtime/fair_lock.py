"""FairLock: the engine lock of ``AsyncLLMEngine``, a FIFO lock that names its holder and can be
given up on.

``release`` hands the lock to the longest waiter, so the step thread, which re-takes the lock right
after each step, cannot starve API calls (new requests, aborts, /metrics). ``acquire(holder=...)`` /
``held_by(name)`` record what holds it, so a shutdown can say what it gave up on; ``abandon`` gives
up on a holder that will not let go (a stuck step): waiters and later callers raise instead of
waiting for ever. It works as the lock of a ``threading.Condition``.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, NamedTuple, Optional

UNNAMED_HOLDER = "a caller"  # what holds a FairLock taken without naming itself


def _slice(until: Callable[[], float], longest: float) -> float:
    """How long to wait before reading the deadline ``until()`` again: what is left of it, at most ``longest``."""
    return max(0.0, min(until() - time.monotonic(), longest))


class _Turn:
    """A waiter's place in a ``FairLock``'s queue: its gate (released when the lock is handed to
    it, or by ``abandon``) and the name it will hold the lock under."""

    __slots__ = ("gate", "holder")

    def __init__(self, holder: str) -> None:
        self.gate = threading.Lock()
        self.gate.acquire()
        self.holder = holder


class Acquisition(NamedTuple):
    """One hold of a ``FairLock``: its ``number`` (the lock counts every time it is taken, so a
    hold let go of and taken again, even under the same name, is another acquisition) and the
    ``holder`` name it was taken under."""

    number: int
    holder: str


class _Hold:
    """``with lock.held_by(name):`` takes the lock as ``name`` for the block."""

    __slots__ = ("lock", "holder")

    def __init__(self, lock: "FairLock", holder: str) -> None:
        self.lock, self.holder = lock, holder

    def __enter__(self) -> bool:
        return self.lock.acquire(holder=self.holder)

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()


class FairLock:
    """A FIFO lock: ``release`` hands the lock to the longest waiter, if any.

    With a plain ``threading.Lock`` the step thread re-takes the lock right after each
    step, before a woken waiter runs, so API calls (new requests, aborts, /metrics, model
    lookups) could wait for the whole batch to finish: 1.3 s of a 2 s run in the hardening
    tests. Works as the lock of a ``threading.Condition`` (acquire/release, non-blocking acquire).

    ``abandon(error)``: its holder will not release it in time (a stuck step): every waiter, and
    every later ``acquire``, raises ``error()`` instead of waiting for ever; the holder's own
    ``release`` (and its ``Condition``'s ``notify``) still works. A ``Condition.wait`` that cannot
    re-take the lock raises too, and the ``release`` its caller's ``with`` block then makes is a
    no-op (``_acquire_restore``). ``abandon(error, only=acquisition)`` does so only if that
    acquisition (see ``acquire_or_holder``) still holds the lock, checked under the lock's own
    mutex: a holder that let go meanwhile is not given up on (False, nothing changed).

    ``holder``: the name its holder took it under (``acquire(holder=...)``, ``held_by``; None while
    free), so that ``shutdown`` can say what it gave up on. It is set with the hold itself (also
    when ``release`` hands the lock over, and kept across a ``Condition.wait``): one attribute store.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self.holder: Optional[str] = None
        self._taken = 0  # how many times the lock was taken: the number of the acquisition holding it
        self._waiters: deque[_Turn] = deque()
        self._abandoned: Optional[Callable[[], BaseException]] = None
        self.abandoned_holder: Optional[str] = None  # the name the hold given up on was taken under (set by abandon())
        self._dismissed: set[_Turn] = set()  # waiters abandon() woke without handing them the lock
        self._unheld: set[int] = set()  # threads whose Condition.wait raised without re-taking the lock: their next release is a no-op

    def held_by(self, holder: str) -> _Hold:
        """A context manager that takes the lock as ``holder`` (see the class docstring)."""
        return _Hold(self, holder)

    @property
    def abandoned(self) -> bool:
        """``abandon`` gave up on the lock (set before any waiter is woken by it)."""
        return self._abandoned is not None

    def abandon(self, error: Callable[[], BaseException], only: Optional[Acquisition] = None) -> bool:
        """Give up on the lock (see the class docstring); with ``only``, just if that acquisition
        still holds it. True if the lock is abandoned now."""
        with self._mutex:
            if only is not None and (not self._held or self._taken != only.number):
                return False  # let go of (and perhaps taken again) since: not stuck
            self._abandoned = error
            self.abandoned_holder = only.holder if only is not None else self.holder
            dismissed, self._waiters = list(self._waiters), deque()
            self._dismissed.update(dismissed)
        for turn in dismissed:
            turn.gate.release()
        return True

    def acquire(self, blocking: bool = True, timeout: float = -1, holder: str = UNNAMED_HOLDER) -> bool:
        return self.acquire_or_holder(blocking, timeout, holder)[0]

    def acquire_or_holder(self, blocking: bool = True, timeout: float = -1, holder: str = UNNAMED_HOLDER,
                          until: Optional[Callable[[], float]] = None) -> tuple[bool, Optional[Acquisition]]:
        """``acquire``: (True, None) once taken; else (False, the acquisition that held the lock as
        the wait ended, read under the lock's mutex), which ``abandon(error, only=...)`` takes.

        ``until``: wait until that ``time.monotonic()`` deadline instead, in the place in the queue
        taken at the call; ``until()`` is read again every ``timeout`` s (> 0), as it may come
        sooner meanwhile (a later ``shutdown`` call's). A wait in slices of plain ``acquire(timeout=)``
        calls would leave the queue after each and join it again at the back, behind everyone who
        came meanwhile: unfair to a shutdown waiting for its turn to fail the requests."""
        if until is not None and not timeout > 0:
            raise ValueError(f"FairLock: acquire_or_holder(until=...) reads the deadline every timeout s, which must be > 0, got {timeout!r}")
        with self._mutex:
            if self._abandoned is not None:
                raise self._abandoned()
            if not self._held and not self._waiters:
                self._held = True
                self._taken += 1
                self.holder = holder
                return True, None
            if not blocking:
                return False, self._acquisition()
            turn = _Turn(holder)
            self._waiters.append(turn)
        try:
            woken = turn.gate.acquire(timeout=timeout if until is None else _slice(until, timeout))  # released by release() (handed over) or abandon()
            while not woken and until is not None and until() > time.monotonic():
                woken = turn.gate.acquire(timeout=_slice(until, timeout))
        except BaseException:  # interrupted (Ctrl-C in the main thread): leave the queue, or pass on what came
            with self._mutex:
                if turn in self._waiters:
                    self._waiters.remove(turn)
                    raise
                if turn in self._dismissed:  # abandon() woke it: nothing was handed over
                    self._dismissed.discard(turn)
                    raise
            self.release()  # handed over meanwhile: a lock nobody would release otherwise
            raise
        with self._mutex:
            if turn in self._dismissed:
                self._dismissed.discard(turn)
                assert self._abandoned is not None
                raise self._abandoned()
            if not woken and turn in self._waiters:
                self._waiters.remove(turn)
                return False, self._acquisition()
        return True, None  # handed over (perhaps just as the timeout expired)

    def _acquisition(self) -> Optional[Acquisition]:
        """The acquisition holding the lock (None while free); the mutex is held."""
        return Acquisition(self._taken, self.holder or UNNAMED_HOLDER) if self._held else None

    def _is_owned(self) -> bool:
        """``threading.Condition``'s check that its lock is held before ``wait``/``notify``. Its
        fallback probes with a non-blocking ``acquire``, which raises once the lock is abandoned,
        so the holder's ``notify`` would fail where its ``release`` works."""
        return self._held

    def _release_save(self) -> Optional[str]:
        """``threading.Condition.wait``'s release of the lock: the holder's name, which
        ``_acquire_restore`` takes the lock back under."""
        holder = self.holder
        self.release()
        return holder

    def _acquire_restore(self, holder: Optional[str]) -> None:
        """``threading.Condition.wait``'s re-take of the lock once woken. Should that ``acquire``
        raise (the lock was abandoned meanwhile: the idle step thread woken by an abort), the wait
        raises without the lock, but its caller's ``with`` block still releases it on the way out,
        which raised "release of an unheld FairLock" or, were another thread holding the lock,
        cleared that thread's hold. So this thread's next ``release`` is made a no-op."""
        try:
            self.acquire(holder=holder or UNNAMED_HOLDER)
        except BaseException:
            with self._mutex:
                self._unheld.add(threading.get_ident())
            raise

    def release(self) -> None:
        with self._mutex:
            if self._unheld:
                me = threading.get_ident()
                if me in self._unheld:  # the release after a Condition.wait that raised without the lock
                    self._unheld.discard(me)
                    return
            if not self._held:
                raise RuntimeError("release of an unheld FairLock")
            if self._waiters:
                turn = self._waiters.popleft()
                self._taken += 1
                self.holder = turn.holder
                turn.gate.release()  # stays held: now by that waiter
            else:
                self._held = False
                self.holder = None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
