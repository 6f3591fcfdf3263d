"""BoundedWorkers: a few named threads of their own for one kind of blocking work, with a bound
on how many calls may be in progress.

Work run with ``asyncio.to_thread`` shares the event loop's default executor
(``min(32, cores + 4)`` threads) with ``/metrics`` and the encoding of long prompts and long
logprobs objects; a kind of work that can take long (an adapter load, a chat template's
render) gets ``threads`` threads of its own here instead, so however long it takes it never
holds those up.

At most ``max_in_progress`` calls are in progress at a time, running or waiting for one of the
threads; one more is refused at once with the subclass's ``busy`` error (its route's 429), so a
backlog whose clients gave up cannot pile up. A call counts until its work ends, even if its
caller went away meanwhile (the work goes on in its thread); one still waiting for a thread
when its caller goes away is dropped. ``shutdown`` drops the calls still waiting and lets the
threads end once their work has (the server's shutdown); a call after it starts new threads.

The threads are daemons (``DaemonExecutor``): an admin load can hold the engine lock, and one
stuck there, which the engine's shutdown gives up on, must not keep the process from exiting
(a ``ThreadPoolExecutor``'s threads are joined at exit).
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, TypeVar

from runtime.daemon_executor import DaemonExecutor

T = TypeVar("T")


class BoundedWorkers:
    """See the module docstring. ``run`` is called from the event loop; the count is also
    lowered from the worker threads (a done callback), hence its lock. ``thread_name``: the
    threads' name prefix; ``initializer``: run in each thread first."""

    def __init__(self, threads: int, max_in_progress: int, thread_name: str, initializer: Optional[Callable[[], Any]] = None) -> None:
        kind = type(self).__name__
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"{kind}: threads must be an integer >= 1, got {threads!r}")
        if isinstance(max_in_progress, bool) or not isinstance(max_in_progress, int) or max_in_progress < threads:
            raise ValueError(f"{kind}: max_in_progress must be an integer >= threads ({threads}), got {max_in_progress!r}")
        self.threads, self.max_in_progress = threads, max_in_progress
        self._thread_name, self._initializer = thread_name, initializer
        self._executor = self._new_executor()
        self._shut_down = False  # the executor is shut down: the next call makes a new one
        self._lock = threading.Lock()
        self._in_progress = 0

    @property
    def in_progress(self) -> int:
        return self._in_progress

    def busy(self, in_progress: int) -> Exception:
        """The error ``run`` raises when ``in_progress`` calls (``max_in_progress``) already are."""
        raise NotImplementedError

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in one of the threads; ``busy(...)`` at once if too many calls are in progress."""
        with self._lock:
            if self._in_progress >= self.max_in_progress:
                raise self.busy(self._in_progress)
            self._in_progress += 1
            if self._shut_down:
                self._executor, self._shut_down = self._new_executor(), False
            executor = self._executor
        try:
            work = executor.submit(fn, *args)
        except BaseException:
            self._finished(None)
            raise
        work.add_done_callback(self._finished)
        return await asyncio.wrap_future(work)

    def shutdown(self) -> None:
        """Drop the calls waiting for a thread and let the threads end once their work has;
        returns at once. A later ``run`` starts new threads (an app used again after its
        lifespan ended: a test client entering it once more, or one driving it without a lifespan)."""
        with self._lock:
            self._shut_down = True
            executor = self._executor
        executor.shutdown(wait=False, cancel_futures=True)

    def _new_executor(self) -> DaemonExecutor:
        return DaemonExecutor(max_workers=self.threads, thread_name_prefix=self._thread_name, initializer=self._initializer)

    def _finished(self, _work: "Future[Any] | None") -> None:
        with self._lock:
            self._in_progress -= 1
