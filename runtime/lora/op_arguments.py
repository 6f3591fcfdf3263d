"""Argument rules that every backend's LoRA ops share: what a caller may pass as an output
buffer, as slice offsets, and as batch metadata, whatever kernel then runs on them."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights


def elements_may_share_memory(t: Tensor) -> bool:
    """True unless ``t``'s strides place every element apart: each dimension of more than one
    element, by increasing stride, must step past everything the smaller ones span. A broadcast
    row (``expand``, a zero stride) fails; so would a rare interleaving that does not overlap,
    which the ops then refuse too. Written-to buffers that fail would have several rows'
    updates land in one place (summed, or the last one winning, or a race on a device)."""
    if t.is_contiguous():  # the common case, at the cost of one call
        return False
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


def check_shrink(x: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, out: Tensor) -> None:
    """``shrink``'s arguments (and ``apply``'s x and workspace): ``out`` is [>= n_slices, T, >= max rank]
    with its own memory per element, ``x`` is [T, in] for every slice, ``meta`` describes those T rows."""
    if not weights:
        raise ValueError("shrink: weights is empty; pass one LoRASliceWeights per slice")
    if x.dim() != 2:
        raise ValueError(f"shrink: x must be 2-D [T, in], got shape {tuple(x.shape)}")
    check_rows_and_slots("shrink", meta, x.shape[0], min(w.max_slots for w in weights))
    if out.dim() != 3 or out.shape[0] < len(weights) or out.shape[1] != x.shape[0]:
        raise ValueError(f"shrink: out must be [n_slices={len(weights)}, T={x.shape[0]}, R], got {tuple(out.shape)}")
    if elements_may_share_memory(out):
        raise ValueError(f"shrink: out's elements share memory (shape {tuple(out.shape)}, strides {out.stride()}); "
                         "pass a tensor with its own memory per element")  # fmt: skip
    for i, w in enumerate(weights):
        if w.in_features != x.shape[1]:
            raise ValueError(f"shrink: x has {x.shape[1]} features, slice {i} expects {w.in_features}")
        if w.max_rank > out.shape[2]:
            raise ValueError(f"shrink: out holds rank {out.shape[2]}, slice {i} has a slot of rank {w.max_rank}")


def check_expand(h: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, y: Tensor, slice_offsets: Sequence[int]) -> None:
    """``expand``'s arguments (and ``apply``'s y): integer offsets, each slice's columns inside ``y``,
    ``y``'s rows apart in memory, and ``h`` and ``meta`` for ``y``'s rows."""
    if not weights:
        raise ValueError("expand: weights is empty; pass one LoRASliceWeights per slice")
    if len(slice_offsets) != len(weights):
        raise ValueError(f"expand: {len(weights)} slices but {len(slice_offsets)} offsets")
    check_offsets("expand", slice_offsets)
    if y.dim() != 2:
        raise ValueError(f"expand: y must be 2-D [T, out], got shape {tuple(y.shape)}")
    check_rows_and_slots("expand", meta, y.shape[0], min(w.max_slots for w in weights))
    if elements_may_share_memory(y):
        raise ValueError(f"expand: y's rows share memory (shape {tuple(y.shape)}, strides {y.stride()}); "
                         "pass a tensor with its own memory per row")  # fmt: skip
    for i, (off, w) in enumerate(zip(slice_offsets, weights)):
        if off + w.out_features > y.shape[1]:
            raise ValueError(f"expand: slice {i} at {off} with {w.out_features} columns exceeds y's {y.shape[1]}")
    if h.shape[1] != y.shape[0]:
        raise ValueError(f"expand: h has {h.shape[1]} rows, y has {y.shape[0]}")
