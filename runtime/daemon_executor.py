"""DaemonExecutor: a thread pool whose threads are daemons, for work that may hold the engine lock.

``concurrent.futures.ThreadPoolExecutor`` registers an exit hook that joins every worker thread
it ever started, and ``asyncio.to_thread`` runs on such an executor. So a worker stuck holding the
engine lock (an adapter install stuck in ``clear_slot`` on a hung device, a ``/metrics`` snapshot,
an admin route's load) kept the process from exiting, even once ``AsyncLLMEngine.shutdown`` had
returned and said it gave up on that holder. Here the threads are daemons: the interpreter does
not wait for them, and one stuck for good is simply left behind at exit. (``FileReader`` does the
same for adapter file reads, one at a time and in order; this is the pool for the rest.)

It is a ``concurrent.futures.Executor``: ``submit`` returns a ``Future``, and ``asyncio``'s
``run_in_executor`` and ``wrap_future`` take it. Threads are started as work comes in, up to
``max_workers``, and only when none is idle, as ``ThreadPoolExecutor`` does; they end after
``shutdown``, once the work queued before it has run (or was cancelled), or once the executor is
garbage-collected.
"""
from __future__ import annotations

import queue
import threading
import weakref
from concurrent.futures import BrokenExecutor, Executor, Future
from typing import Any, Callable, Optional

_Work = tuple["Future[Any]", Callable[..., Any], tuple, dict]


class DaemonExecutor(Executor):
    """See the module docstring. ``initializer`` runs first in each thread (as an executor's); if
    it raises, the work that thread takes fails with ``BrokenExecutor`` naming the error."""

    def __init__(self, max_workers: int, thread_name_prefix: str, initializer: Optional[Callable[[], Any]] = None) -> None:
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"DaemonExecutor: max_workers must be an integer >= 1, got {max_workers!r}")
        self.max_workers = max_workers
        self._name, self._initializer = thread_name_prefix, initializer
        self._work: "queue.SimpleQueue[Optional[_Work]]" = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one release per thread waiting for work
        self._lock = threading.Lock()  # guards _threads and _shut
        self._threads: list[threading.Thread] = []
        self._shut = False
        work = self._work  # not self: the callback must not keep the executor alive
        # An executor nobody references is collected: its threads, told by this callback, end.
        self._on_collect = weakref.ref(self, lambda _: work.put(None))

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> "Future[Any]":
        """Queue ``fn(*args, **kwargs)``; RuntimeError once shut down (as ``ThreadPoolExecutor``)."""
        future: "Future[Any]" = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self.max_workers:
                self._start_thread()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new work (``submit`` raises); with ``cancel_futures``, work not started yet is
        cancelled; the threads end once the queue is empty. ``wait``: join them (never do that for
        a thread that may be stuck: that is what this executor is for)."""
        with self._lock:
            self._shut = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    work = self._work.get_nowait()
                except queue.Empty:
                    break
                if work is not None:
                    work[0].cancel()
        self._work.put(None)  # each thread that takes it puts it back for the next, and ends
        if wait:
            for thread in threads:
                thread.join()

    def _start_thread(self) -> None:
        """A new daemon thread; ``_lock`` is held. It holds the queue, not the executor."""
        thread = threading.Thread(target=_serve, args=(self._work, self._idle, self._initializer),
                                  name=f"{self._name}_{len(self._threads)}", daemon=True)
        thread.start()
        self._threads.append(thread)


def _serve(work: "queue.SimpleQueue[Optional[_Work]]", idle: threading.Semaphore,
           initializer: Optional[Callable[[], Any]]) -> None:
    """A thread's loop: run work until the ``None`` that ``shutdown`` (or the executor's collection)
    queued, which it passes on to the other threads. A module function, given only the queue: the
    thread must not keep the executor alive. ``idle`` is released each time it waits for work again
    (``submit`` starts no new thread while one is idle; the count is loose, as ``ThreadPoolExecutor``'s)."""
    broken: Optional[BaseException] = None
    if initializer is not None:
        try:
            initializer()
        except BaseException as err:  # noqa: BLE001 - each piece of work this thread takes reports it
            broken = err
    while True:
        item = work.get()
        if item is None:
            work.put(None)
            return
        future, fn, args, kwargs = item
        del item
        if future.set_running_or_notify_cancel():  # False: cancelled by its caller while queued
            if broken is not None:
                future.set_exception(BrokenExecutor(f"the thread's initializer failed: {type(broken).__name__}: {broken}"))
            else:
                try:
                    result = fn(*args, **kwargs)
                except BaseException as err:  # noqa: BLE001 - handed to the future's caller
                    future.set_exception(err)
                else:
                    future.set_result(result)
                    del result
        del future, fn, args, kwargs  # nothing of the work stays referenced while the thread waits
        idle.release()
