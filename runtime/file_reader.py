"""FileReader: adapter file reads, run one at a time and in order, in a daemon thread of its own.

A read cannot be interrupted: one stuck on a hung network mount stays stuck. In a
``ThreadPoolExecutor`` that becomes everyone's wait: the interpreter joins the executor's
threads when the process exits, and each caller blocked in ``Future.result()`` (an admin
route's worker thread, itself an executor's) waits as long. Here the thread is a daemon, and
``give_up`` fails every read not finished yet, so that their callers stop waiting; a read still
running goes on in the thread, and what it returns is dropped.

Each read's future is finished by exactly one side: the thread (the read's outcome) or
``give_up`` (its error), whichever takes it out of ``_pending`` first, under ``_lock``. A
caller may cancel a future while its read is queued (as ``asyncio.wrap_future`` does when its
task is cancelled): that read is skipped.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable, Optional

_Item = tuple["Future[Any]", Callable[..., Any], tuple, dict]


class FileReader:
    """See the module docstring. ``initializer`` runs first in the thread (as an executor's)."""

    def __init__(self, name: str, initializer: Optional[Callable[[], None]] = None) -> None:
        self._queue: "queue.SimpleQueue[Optional[_Item]]" = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _pending and _shut
        self._pending: dict["Future[Any]", str] = {}  # reads asked for and not finished, and what each reads
        self._shut = False
        self._thread = threading.Thread(target=self._run, args=(initializer,), name=name, daemon=True)
        self._thread.start()

    def submit(self, what: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> "Future[Any]":
        """Queue ``fn(*args, **kwargs)``; ``what`` names it (``pending``, ``give_up``). RuntimeError
        once shut down, as a shut-down executor's ``submit``."""
        future: "Future[Any]" = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("FileReader: shut down; no new reads")
            self._pending[future] = what
            self._queue.put((future, fn, args, kwargs))
        return future

    def pending(self) -> list["Future[Any]"]:
        """The futures of the reads queued or running."""
        with self._lock:
            return list(self._pending)

    def shutdown(self) -> None:
        """No new reads (``submit`` raises); those queued still run, in order, then the thread ends.
        Returns at once."""
        with self._lock:
            if not self._shut:
                self._shut = True
                self._queue.put(None)

    def give_up(self, error: Callable[[str], BaseException]) -> list[str]:
        """Finish every read queued or running with ``error(what)``, so that no caller waits for it;
        a queued one will not run, a running one goes on in the thread and its outcome is dropped.
        Returns what they read, each marked "(running)" or "(queued)"."""
        with self._lock:
            left, self._pending = self._pending, {}
        given_up = []
        for future, what in left.items():
            state = "running" if future.running() else "queued"
            try:
                future.set_exception(error(what))
            except InvalidStateError:  # its caller cancelled it while queued: nobody waits for it
                continue
            given_up.append(f"{what} ({state})")
        return given_up

    def _run(self, initializer: Optional[Callable[[], None]]) -> None:
        if initializer is not None:
            initializer()
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._read(*item)
            del item  # nothing of a read stays referenced while the thread waits for the next

    def _read(self, future: "Future[Any]", fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        with self._lock:
            if future not in self._pending:  # given up on while queued
                return
            if not future.set_running_or_notify_cancel():  # cancelled by its caller while queued
                del self._pending[future]
                return
        try:
            result = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - handed to the future's caller
            if self._take(future):
                future.set_exception(err)
        else:
            if self._take(future):
                future.set_result(result)

    def _take(self, future: "Future[Any]") -> bool:
        """Whether the thread finishes ``future`` (False: ``give_up`` did already)."""
        with self._lock:
            return self._pending.pop(future, None) is not None
