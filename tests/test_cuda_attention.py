"""backends/cuda/attention.py: the cuda backend's paged attention keeps SDPA off cuDNN (which builds
an execution plan per new shape, and a decode step's shape is new almost every step), puts torch's
SDPA flags back as they were, even across threads, and computes exactly what ReferenceAttention does.

Runs on the CPU: the backend choice is torch's process-wide flags, readable on any machine; on a
GPU the capability tests (`-m cuda`, paged_attention) check the numbers through CudaBackend."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from backends.cuda.attention import CudaAttention
from backends.reference import ReferenceAttention
from runtime.verifiers.attention import MIXED_STEP, NUM_BLOCKS, _tables
from runtime.verifiers.attention_problem import random_cache, random_step

CUDA = torch.backends.cuda
SETTERS = (CUDA.enable_cudnn_sdp, CUDA.enable_flash_sdp, CUDA.enable_mem_efficient_sdp, CUDA.enable_math_sdp)


def _flags() -> tuple[bool, bool, bool, bool]:
    """(cudnn, flash, memory-efficient, math) SDPA enabled."""
    return CUDA.cudnn_sdp_enabled(), CUDA.flash_sdp_enabled(), CUDA.mem_efficient_sdp_enabled(), CUDA.math_sdp_enabled()


@contextmanager
def _flags_set_to(state: tuple[bool, bool, bool, bool]):
    """Start from ``state`` (not torch's default, so a wrapper that restores the defaults fails);
    torch's own flags come back afterwards whatever happens."""
    saved = _flags()
    for setter, on in zip(SETTERS, state):
        setter(on)
    try:
        yield
    finally:
        for setter, on in zip(SETTERS, saved):
            setter(on)


def _step(seed: int):
    g = torch.Generator().manual_seed(seed)
    query_lens, context_lens = [q for q, _ in MIXED_STEP], [c for _, c in MIXED_STEP]
    cache = random_cache(NUM_BLOCKS, torch.float32, torch.device("cpu"), g)
    return cache, random_step(query_lens, context_lens, _tables(context_lens, g), torch.float32, torch.device("cpu"), g)


def _spy_sdpa(monkeypatch: pytest.MonkeyPatch, seen: list, pause_s: float = 0.0) -> None:
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(_flags())
        time.sleep(pause_s)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)


def test_every_sdpa_call_runs_without_cudnn_and_the_flags_come_back(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []
    _spy_sdpa(monkeypatch, seen)
    seed = int(torch.randint(0, 2**31 - 1, ()))
    cache, step = _step(seed)
    start = (True, False, True, False)  # cuDNN on, flash and math off
    with _flags_set_to(start):
        CudaAttention().paged_attention(step.q, step.k, step.v, cache, step.meta, step.scale)
        after = _flags()
    assert len(seen) >= 2, seed  # the mixed step has a decode group and prefill chunks
    assert all(flags == (False, True, True, True) for flags in seen), (seed, seen)
    assert after == start


def test_flags_come_back_when_attention_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(F, "scaled_dot_product_attention", broken)
    cache, step = _step(seed=3)
    start = (True, True, False, True)
    with _flags_set_to(start):
        with pytest.raises(RuntimeError, match="boom"):
            CudaAttention().paged_attention(step.q, step.k, step.v, cache, step.meta, step.scale)
        assert _flags() == start


def test_two_threads_in_attention_at_once_leave_the_flags_as_they_found_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each engine steps on its own thread. Thread A pauses inside its first SDPA call until B is
    about to enter attention (and 0.2 s more, for B to get in if nothing stops it), and B pauses in
    its first SDPA call until A has finished. Without serialized windows A restores the flags while
    B is inside (cuDNN back on for B's next call) and B restores A's changed flags last (cuDNN off
    for the whole process)."""
    seen: list = []
    real = F.scaled_dot_product_attention
    a_inside, b_entering, b_inside, a_done = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def spy(*args, **kwargs):
        seen.append((threading.current_thread().name, _flags()))
        if threading.current_thread().name == "A" and not a_inside.is_set():
            a_inside.set()
            assert b_entering.wait(timeout=5)
            b_inside.wait(timeout=0.2)  # without the lock B is inside by now; with it, B waits for A
        elif threading.current_thread().name == "B" and not b_inside.is_set():
            b_inside.set()
            a_done.wait(timeout=5)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    (cache_a, step_a), (cache_b, step_b) = _step(11), _step(12)
    errors: list = []

    def run(cache, step, done, entering=None):  # type: ignore[no-untyped-def]
        if entering is not None:
            entering.set()
        try:
            CudaAttention().paged_attention(step.q, step.k, step.v, cache, step.meta, step.scale)
        except Exception as err:  # surfaced below, not lost in the thread
            errors.append(err)
        done.set()

    with _flags_set_to((True, True, True, True)):
        a = threading.Thread(target=run, args=(cache_a, step_a, a_done), name="A")
        b = threading.Thread(target=run, args=(cache_b, step_b, threading.Event(), b_entering), name="B")
        a.start()
        assert a_inside.wait(timeout=5)
        b.start()
        a.join(timeout=10)
        b.join(timeout=10)
        after = _flags()
    assert not errors, errors
    assert {name for name, _ in seen} == {"A", "B"} and len(seen) >= 4
    assert all(flags[0] is False for _, flags in seen), seen
    assert after == (True, True, True, True)


def test_same_output_and_cache_as_the_reference() -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()))
    cache_a, step = _step(seed)
    cache_b = cache_a.clone()
    want = ReferenceAttention().paged_attention(step.q, step.k, step.v, cache_a, step.meta, step.scale)
    got = CudaAttention().paged_attention(step.q, step.k, step.v, cache_b, step.meta, step.scale)
    assert torch.equal(got, want), seed
    assert torch.equal(cache_b, cache_a), seed


def test_the_cuda_backend_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaBackend built without a GPU (availability and the current device stood in for)."""
    pytest.importorskip("triton")
    from backends.cuda.backend import CudaBackend

    monkeypatch.setattr(CudaBackend, "availability", staticmethod(lambda: (True, "cuda: stand-in")))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert isinstance(CudaBackend("cuda").attention, CudaAttention)
