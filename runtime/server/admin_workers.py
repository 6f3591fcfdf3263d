"""AdminWorkers: the threads the adapter admin routes block on, apart from every other route's.

A load blocks a thread for as long as the adapter's files take to read and hash (and, under
``--ray``, for the registry's round trip to every replica); an unload for as long as the engine
lock (one step) or that round trip takes. On the event loop's default executor
(``asyncio.to_thread``), ``min(32, cores + 4)`` slow loads at once took every thread that
``/metrics``, the encoding of long prompts and long logprobs objects wait for, and those
stalled until a load ended. Here they get ``threads`` threads of their own.

At most ``max_in_progress`` admin calls are in progress at a time, running or waiting for one
of the threads; one more is refused at once with ``AdminBusy`` (the route's 429), so a backlog
of loads whose clients gave up cannot pile up. A call counts until its work ends, even if its
caller went away meanwhile (the work goes on in its thread); one still waiting for a thread
when its caller goes away is dropped.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from runtime.torch_threads import single_threaded_torch

T = TypeVar("T")
ADMIN_THREADS = 4  # admin calls running at once (single server: the engine still reads one adapter at a time)
ADMIN_MAX_IN_PROGRESS = 32  # running or waiting for a thread; past it, a 429


class AdminBusy(Exception):
    """``max_in_progress`` admin calls are already in progress."""


class AdminWorkers:
    """See the module docstring. ``run`` is called from the event loop; the count is also
    lowered from the worker threads (a done callback), hence its lock."""

    def __init__(self, threads: int = ADMIN_THREADS, max_in_progress: int = ADMIN_MAX_IN_PROGRESS) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"AdminWorkers: threads must be an integer >= 1, got {threads!r}")
        if isinstance(max_in_progress, bool) or not isinstance(max_in_progress, int) or max_in_progress < threads:
            raise ValueError(f"AdminWorkers: max_in_progress must be an integer >= threads ({threads}), got {max_in_progress!r}")
        self.threads, self.max_in_progress = threads, max_in_progress
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lorafleet-admin", initializer=single_threaded_torch)
        self._lock = threading.Lock()
        self._in_progress = 0

    @property
    def in_progress(self) -> int:
        return self._in_progress

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in one of the admin threads; ``AdminBusy`` at once if too many calls are in progress."""
        with self._lock:
            if self._in_progress >= self.max_in_progress:
                raise AdminBusy(f"{self._in_progress} adapter loads and unloads are already in progress (at most {self.max_in_progress}, "
                                f"{self.threads} at a time); retry when one has finished")
            self._in_progress += 1
        try:
            work = self._executor.submit(fn, *args)
        except BaseException:
            self._finished(None)
            raise
        work.add_done_callback(self._finished)
        return await asyncio.wrap_future(work)

    def _finished(self, _work: "Future[Any] | None") -> None:
        with self._lock:
            self._in_progress -= 1
