"""Paged attention on NVIDIA GPUs: the reference gather + SDPA, kept off cuDNN's SDPA.

The math is ``ReferenceAttention``'s (gather each sequence's KV blocks, then SDPA with a
mask per row's context). Only the SDPA backend changes: every call runs with cuDNN
attention excluded, so torch picks flash attention where it applies (fp16/bf16 with no mask: a
decode group whose contexts are all one length), and memory-efficient or math attention otherwise.

Why: a decode step's attention has a new shape almost every step (the longest context
grows by one token, the batch changes as requests come and go), and the masks are
explicit tensors. torch 2.11 on sm_90 sends such calls to cuDNN first, and cuDNN builds an
execution plan for every shape it has not seen. Measured on an H200 (2026-11-30, an 8-layer
hidden-2048 bf16 model, 96 requests of ~200 prompt and ~75 output tokens), a fresh engine's
first pass over the workload: 46-49 ms a step in its last 60 steps with cuDNN, with or without
adapters and with ``expandable_segments``; without cuDNN, 6.3 ms (no adapters) and 11.4 ms (with
adapters). Flash and memory-efficient attention build no per-shape plan. The price: when the
same shapes come round again (cuDNN's plans cached), steps were 7-14% slower without it
(7.4 -> 7.9 ms without adapters, 10.5 -> 12.0 ms with; two machine starts, which differed by up
to 5% on their own).

The backend choice is set with ``torch.nn.attention.sdpa_kernel``, which changes torch's
process-wide SDPA flags for the duration of the call and restores the previous ones after.
Two such windows overlapping on two threads would restore each other's flags out of order
(leaving cuDNN on inside one call, and off for the whole process after both), so the windows
are serialized by one lock: engines in one process (each steps on its own thread) take turns
in attention. Code outside this module that runs SDPA on another thread while a window is
open gets the same backend choice.
"""
from __future__ import annotations

import threading

from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from backends.reference import ReferenceAttention
from runtime.kv.attention_meta import AttentionMeta

# Every SDPA backend but cuDNN's, in torch's own order of preference among them.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# torch's SDPA flags are process-wide: one window at a time (see the module docstring).
_SDPA_FLAGS = threading.RLock()  # re-entrant: a nested call on the same thread cannot hang


class CudaAttention(ReferenceAttention):
    """``ReferenceAttention`` with SDPA restricted to ``SDPA_BACKENDS`` (no cuDNN)."""

    def paged_attention(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMeta, scale: float) -> Tensor:
        with _SDPA_FLAGS, sdpa_kernel(SDPA_BACKENDS):
            return super().paged_attention(q, k, v, kv_cache, meta, scale)
