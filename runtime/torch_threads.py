"""Keep the engine's step thread the only OpenMP thread team in the process.

With OpenMP, every thread that runs a parallel torch op gets its own team of worker
threads. A second team (e.g. from a helper thread reading adapter files) makes OpenMP
throttle its spin-waits, and the step thread's many small ops then pay a futex wake-up
each: measured ~2x slower multi-LoRA steps on 2 cores (docs/benchmarks.md). Helper
threads call ``single_threaded_torch`` as their initializer so they never start a team;
torch work that must use every core but is not the engine's (a benchmark building weights)
runs through ``in_fresh_thread``, whose thread, and so its team, ends with the work.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, ParamSpec, TypeVar

import torch

P = ParamSpec("P")
T = TypeVar("T")


def single_threaded_torch() -> None:
    """Thread initializer: torch ops in the calling thread run on one core."""
    torch.set_num_threads(1)


def in_fresh_thread(fn: Callable[P, T]) -> Callable[P, T]:
    """Decorator: every call of ``fn`` runs in a new thread, which ends when it returns.

    OpenMP keeps a team of worker threads for each thread that ran a parallel torch op, for as
    long as that thread lives. When a process's main thread does torch work itself (builds
    weights, steps an ``LLMEngine``) and then runs an ``AsyncLLMEngine``, the main thread's idle
    team outlives the work, the process manages more OpenMP threads than it has cores, and
    libgomp shortens every team's spin-wait: the step thread's small ops then pay a futex
    wake-up each. Measured on 2 cores: 411 tokens/s instead of 645 for the same replay after one
    512 x 512 matmul on the main thread (docs/benchmarks.md). A thread that ends takes its team
    with it, so torch work done through this decorator leaves nothing behind.
    Use it where the caller's thread has no team of its own: calling it from a thread that
    already ran torch ops makes two teams live at once, which is the slowdown it avoids (an
    engine benchmark whose main thread had built the model and then stepped engines in such a
    thread measured its LoRA / base ratio at 0.59 instead of 0.84).
    The worker takes the caller's torch thread count; other thread-local torch state (grad
    mode, autocast, default device) is not carried over. Exceptions are re-raised in the caller.
    The worker is a daemon thread, so Ctrl-C in the caller does not wait for it to finish.
    """

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        threads = torch.get_num_threads()  # OpenMP's count is per thread: the worker takes the caller's
        outcome: list[Any] = []

        def work() -> None:
            torch.set_num_threads(threads)
            try:
                outcome.append((True, fn(*args, **kwargs)))
            except BaseException as err:  # handed to the caller
                outcome.append((False, err))

        worker = threading.Thread(target=work, name=f"lorafleet-{getattr(fn, '__name__', 'work')}", daemon=True)
        worker.start()
        worker.join()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    return run
