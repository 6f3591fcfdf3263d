"""Argument rules that every backend's LoRA ops share: what a caller may pass as an output
buffer, as slice offsets, and as batch metadata, whatever kernel then runs on them."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from runtime.lora.batch_meta import LoRABatchMeta


def elements_may_share_memory(t: Tensor) -> bool:
    """True unless ``t``'s strides place every element apart: each dimension of more than one
    element, by increasing stride, must step past everything the smaller ones span. A broadcast
    row (``expand``, a zero stride) fails; so would a rare interleaving that does not overlap,
    which the ops then refuse too. Written-to buffers that fail would have several rows'
    updates land in one place (summed, or the last one winning, or a race on a device)."""
    span = 1
    for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(t.dim()) if t.shape[d] > 1):
        if stride < span:
            return True
        span = stride * size
    return False


def check_offsets(op: str, slice_offsets: Sequence[int]) -> None:
    """Slice offsets are Python integers >= 0 (2.7 is not truncated to 2, True is not column 1)."""
    if any(isinstance(o, bool) or not isinstance(o, int) or o < 0 for o in slice_offsets):
        raise ValueError(f"{op}: slice_offsets must be integers >= 0, got {tuple(slice_offsets)}")


def check_rows_and_slots(op: str, meta: LoRABatchMeta, num_tokens: int, max_slots: int) -> None:
    """``meta`` describes exactly the activations' rows, and uses only slots the weights have."""
    if meta.num_tokens != num_tokens:
        raise ValueError(f"{op}: meta has {meta.num_tokens} token rows, the activations have {num_tokens}")
    top = max(meta.host_seg_slots, default=-1)
    if top >= max_slots:
        raise ValueError(f"{op}: meta uses slot {top}, the weights have only {max_slots} slots")
