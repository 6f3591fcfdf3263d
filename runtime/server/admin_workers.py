"""AdminWorkers: the threads the adapter admin routes block on, apart from every other route's.

A load blocks a thread for as long as the adapter's files take to read and hash (and, under
``--ray``, for the registry's round trip to every replica); an unload for as long as the engine
lock (one step) or that round trip takes. On the event loop's default executor
(``asyncio.to_thread``), ``min(32, cores + 4)`` slow loads at once took every thread that
``/metrics``, the encoding of long prompts and long logprobs objects wait for, and those
stalled until a load ended. Here they get ``threads`` threads of their own (``BoundedWorkers``:
at most ``max_in_progress`` admin calls in progress, one more is refused with ``AdminBusy``, the
route's 429).
"""
from __future__ import annotations

from runtime.server.bounded_workers import BoundedWorkers
from runtime.torch_threads import single_threaded_torch

ADMIN_THREADS = 4  # admin calls running at once (single server: the engine still reads one adapter at a time)
ADMIN_MAX_IN_PROGRESS = 32  # running or waiting for a thread; past it, a 429


class AdminBusy(Exception):
    """``max_in_progress`` admin calls are already in progress."""


class AdminWorkers(BoundedWorkers):
    """``BoundedWorkers`` for adapter loads and unloads (threads named ``lorafleet-admin``, torch
    single-threaded in them)."""

    def __init__(self, threads: int = ADMIN_THREADS, max_in_progress: int = ADMIN_MAX_IN_PROGRESS) -> None:
        super().__init__(threads, max_in_progress, "lorafleet-admin", initializer=single_threaded_torch)

    def busy(self, in_progress: int) -> Exception:
        return AdminBusy(f"{in_progress} adapter loads and unloads are already in progress (at most {self.max_in_progress}, "
                         f"{self.threads} at a time); retry when one has finished")
