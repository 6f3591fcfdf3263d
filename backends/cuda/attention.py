"""Paged attention on NVIDIA GPUs: the reference gather + SDPA, kept off cuDNN's SDPA.

The math is ``ReferenceAttention``'s (gather each sequence's KV blocks, then SDPA with a
mask per row's context). Only the SDPA backend changes: every call runs with cuDNN
attention excluded, so torch picks flash, memory-efficient or math attention instead.

Why: a decode step's attention has a new shape almost every step (the longest context
grows by one token, the batch changes as requests come and go), and the masks are
explicit tensors. torch 2.11 on sm_90 sends such calls to cuDNN first, and cuDNN builds an
execution plan for every shape it has not seen. Measured on an H200 (2026-11-30, an 8-layer
hidden-2048 bf16 model, 96 requests of ~200 prompt and ~75 output tokens): the first pass
of a workload took 47 ms a step in its last 60 decode steps, with or without adapters and
with ``expandable_segments``, against 6 ms when the same shapes came round again. Flash and
memory-efficient attention have no per-shape plan.

The backend choice is set with ``torch.nn.attention.sdpa_kernel``, which changes torch's
process-wide SDPA flags for the duration of the call and restores them after; another
thread running SDPA in that window gets the same choice (the engine runs every forward on
one thread).
"""
from __future__ import annotations

from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from backends.reference import ReferenceAttention
from runtime.kv.attention_meta import AttentionMeta

# Every SDPA backend but cuDNN's, in torch's own order of preference among them.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class CudaAttention(ReferenceAttention):
    """``ReferenceAttention`` with SDPA restricted to ``SDPA_BACKENDS`` (no cuDNN)."""

    def paged_attention(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMeta, scale: float) -> Tensor:
        with sdpa_kernel(SDPA_BACKENDS):
            return super().paged_attention(q, k, v, kv_cache, meta, scale)
