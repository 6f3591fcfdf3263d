"""runtime.torch_threads: torch work that leaves no OpenMP team behind on the caller's thread."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from runtime.torch_threads import in_fresh_thread, single_threaded_torch


def _tids() -> set[str]:
    """The process's OS threads (OpenMP workers included)."""
    return set(os.listdir("/proc/self/task"))


@in_fresh_thread
def _matmul(n: int) -> tuple[float, threading.Thread]:
    return float((torch.ones(n, n) @ torch.ones(n, n))[0, 0]), threading.current_thread()


def _assert_ran_in_a_fresh_thread_that_ended(*workers: threading.Thread) -> None:
    """Each call's own thread (not the caller's, not a pooled one reused), a daemon, gone once the call returned."""
    assert len({id(w) for w in workers}) == len(workers), "two calls ran on the same thread"
    for w in workers:
        assert w is not threading.current_thread() and w is not threading.main_thread()
        assert w.daemon and not w.is_alive()


@in_fresh_thread
def _num_threads() -> int:
    return torch.get_num_threads()


@in_fresh_thread
def _fails() -> None:
    raise KeyError("from the worker")


def test_result_and_error_come_back_from_another_thread() -> None:
    (value, first), (again, second) = _matmul(64), _matmul(64)
    assert value == again == 64.0
    _assert_ran_in_a_fresh_thread_that_ended(first, second)
    with pytest.raises(KeyError, match="from the worker"):
        _fails()
    assert _matmul.__name__ == "_matmul"  # functools.wraps


def test_the_worker_uses_the_callers_thread_count() -> None:
    """New threads start with the count last set on any thread (torch keeps it process-wide),
    e.g. 1 from a single-threaded helper; the worker must use its caller's."""
    before = torch.get_num_threads()
    try:
        for callers in (3, 2):
            torch.set_num_threads(callers)
            helper = threading.Thread(target=single_threaded_torch)  # a new thread would now start with 1
            helper.start()
            helper.join()
            assert torch.get_num_threads() == callers and _num_threads() == callers
    finally:
        torch.set_num_threads(before)  # new threads of later tests start from this count again


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or torch.get_num_threads() < 2, reason="needs /proc and 2+ torch threads")
def test_no_openmp_team_outlives_the_call() -> None:
    """Torch work through the decorator, many times: every OS thread it started is gone
    after each call (an OpenMP team per caller thread would add num_threads - 1 workers that
    stay), while the same work on a long-lived thread leaves its team behind. Counted as
    thread ids, so threads of earlier tests ending meanwhile do not matter."""
    def settle(before: set[str]) -> set[str]:
        """The threads started since ``before`` that are still there after up to 5 s."""
        deadline = time.monotonic() + 5
        while _tids() - before and time.monotonic() < deadline:
            time.sleep(0.02)
        return _tids() - before

    before = _tids()
    workers = []
    for _ in range(3):
        workers.append(_matmul(256)[1])
        assert settle(before) == set()
    _assert_ran_in_a_fresh_thread_that_ended(*workers)

    done, release = threading.Event(), threading.Event()

    def long_lived() -> None:
        _ = torch.ones(256, 256) @ torch.ones(256, 256)
        done.set()
        release.wait(10)

    keeper = threading.Thread(target=long_lived)
    keeper.start()
    done.wait(10)
    try:
        assert len(_tids() - before) >= torch.get_num_threads()  # the thread itself and its team's workers
    finally:
        release.set()
        keeper.join()


def test_single_threaded_torch_sets_one_thread_on_its_thread_only() -> None:
    seen = []

    def helper() -> None:
        single_threaded_torch()
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    t = threading.Thread(target=helper)
    t.start()
    t.join()
    assert seen == [1] and torch.get_num_threads() == before


def _full_and_thread(shape: tuple[int, ...], fill_value: float, dtype: torch.dtype) -> tuple[torch.Tensor, threading.Thread]:
    return torch.full(shape, fill_value, dtype=dtype), threading.current_thread()


def test_any_callable_and_keyword_arguments() -> None:
    import functools

    scaled = in_fresh_thread(functools.partial(_full_and_thread, (2,), dtype=torch.float64))  # no __name__
    (three, first), (four, second) = scaled(fill_value=3.0), scaled(fill_value=4.0)
    assert three.tolist() == [3.0, 3.0] and four.tolist() == [4.0, 4.0] and three.dtype == torch.float64
    _assert_ran_in_a_fresh_thread_that_ended(first, second)
