"""runtime.torch_threads: torch work that leaves no OpenMP team behind on the caller's thread."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from runtime.torch_threads import in_fresh_thread, single_threaded_torch


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@in_fresh_thread
def _matmul(n: int) -> tuple[float, int]:
    return float((torch.ones(n, n) @ torch.ones(n, n))[0, 0]), threading.get_ident()


@in_fresh_thread
def _num_threads() -> int:
    return torch.get_num_threads()


@in_fresh_thread
def _fails() -> None:
    raise KeyError("from the worker")


def test_result_and_error_come_back_from_another_thread() -> None:
    value, ident = _matmul(64)
    assert value == 64.0 and ident != threading.get_ident()
    with pytest.raises(KeyError, match="from the worker"):
        _fails()
    assert _matmul.__name__ == "_matmul"  # functools.wraps


def test_the_worker_uses_the_callers_thread_count() -> None:
    """New threads start with the count last set on any thread (torch keeps it process-wide),
    e.g. 1 from a single-threaded helper; the worker must use its caller's."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _num_threads() == 1
    finally:
        torch.set_num_threads(before)
    helper = threading.Thread(target=single_threaded_torch)
    helper.start()
    helper.join()
    try:
        assert torch.get_num_threads() == before and _num_threads() == before
    finally:
        torch.set_num_threads(before)  # new threads of later tests start from this count again


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or torch.get_num_threads() < 2, reason="needs /proc and 2+ torch threads")
def test_no_openmp_team_outlives_the_call() -> None:
    """Torch work through the decorator, many times: the process's thread count comes back
    down each time (an OpenMP team per caller thread would add num_threads - 1 workers that
    stay), while the same work on a long-lived thread leaves its team behind."""
    def settle(target: int) -> int:
        deadline = time.monotonic() + 5
        while _threads() > target and time.monotonic() < deadline:
            time.sleep(0.02)
        return _threads()

    before = _threads()
    for _ in range(3):
        _matmul(256)
        assert settle(before) == before

    done, release = threading.Event(), threading.Event()

    def long_lived() -> None:
        _ = torch.ones(256, 256) @ torch.ones(256, 256)
        done.set()
        release.wait(10)

    keeper = threading.Thread(target=long_lived)
    keeper.start()
    done.wait(10)
    try:
        assert _threads() >= before + torch.get_num_threads()  # the thread itself and its team's workers
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


def test_any_callable_and_keyword_arguments() -> None:
    import functools

    scaled = in_fresh_thread(functools.partial(torch.full, (2,), dtype=torch.float64))  # no __name__
    assert scaled(fill_value=3.0).tolist() == [3.0, 3.0]
