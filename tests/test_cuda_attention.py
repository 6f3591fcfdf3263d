"""backends/cuda/attention.py: the cuda backend's paged attention keeps SDPA off cuDNN (which builds
an execution plan per new shape, and a decode step's shape is new almost every step), restores
torch's SDPA flags afterwards, and computes exactly what ReferenceAttention computes.

Runs on the CPU: the backend choice is torch's process-wide flags, readable on any machine; on a
GPU the capability tests (`-m cuda`, paged_attention) check the numbers through CudaBackend."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.cuda.attention import CudaAttention
from backends.reference import ReferenceAttention
from runtime.verifiers.attention import MIXED_STEP, NUM_BLOCKS, _tables
from runtime.verifiers.attention_problem import random_cache, random_step


def _step(seed: int):
    g = torch.Generator().manual_seed(seed)
    query_lens, context_lens = [q for q, _ in MIXED_STEP], [c for _, c in MIXED_STEP]
    cache = random_cache(NUM_BLOCKS, torch.float32, torch.device("cpu"), g)
    return cache, random_step(query_lens, context_lens, _tables(context_lens, g), torch.float32, torch.device("cpu"), g)


def test_every_sdpa_call_runs_without_cudnn_and_the_flags_come_back(monkeypatch):
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    cache, step = _step(seed=int(torch.randint(0, 2**31 - 1, ())))
    CudaAttention().paged_attention(step.q, step.k, step.v, cache, step.meta, step.scale)
    assert len(seen) >= 2  # the mixed step has a decode group and prefill chunks
    assert all(flags == (False, True, True, True) for flags in seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_flags_come_back_when_attention_raises(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(F, "scaled_dot_product_attention", broken)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    cache, step = _step(seed=3)
    try:
        CudaAttention().paged_attention(step.q, step.k, step.v, cache, step.meta, step.scale)
    except RuntimeError:
        pass
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_same_output_and_cache_as_the_reference():
    seed = int(torch.randint(0, 2**31 - 1, ()))
    cache_a, step = _step(seed)
    cache_b = cache_a.clone()
    want = ReferenceAttention().paged_attention(step.q, step.k, step.v, cache_a, step.meta, step.scale)
    got = CudaAttention().paged_attention(step.q, step.k, step.v, cache_b, step.meta, step.scale)
    assert torch.equal(got, want)
    assert torch.equal(cache_b, cache_a)
