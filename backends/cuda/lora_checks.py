"""Argument checks shared by the LoRA kernel launchers (host metadata only, no device reads).

Every argument a launcher takes is either honoured or rejected here with an error
naming the op, the argument and what was expected.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from backends.cuda.kernel_config import SUPPORTED_DTYPES
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def check_weights(op: str, weights: Sequence[LoRASliceWeights], device: torch.device, dtype: torch.dtype) -> None:
    if len(weights) == 0:
        _fail(op, "weights is empty; pass one LoRASliceWeights per slice")
    for i, w in enumerate(weights):
        for name in ("a_rows", "b_rows"):
            t = getattr(w, name)
            if t.dtype != dtype:
                _fail(op, f"weights[{i}].{name} is {t.dtype}, the activations are {dtype}")
            if t.dim() != 2 or not t.is_contiguous():
                _fail(op, f"weights[{i}].{name} must be a contiguous 2-D tensor, got shape {tuple(t.shape)}")
        for name, want in (("slot_start", torch.int32), ("slot_rank", torch.int32), ("slot_scale", torch.float32)):
            t = getattr(w, name)
            if t.dtype != want or t.dim() != 1 or not t.is_contiguous():
                _fail(op, f"weights[{i}].{name} must be a contiguous 1-D {want} tensor, got {t.dtype} {tuple(t.shape)}")
        for name in ("a_rows", "b_rows", "slot_start", "slot_rank", "slot_scale"):
            if getattr(w, name).device != device:
                _fail(op, f"weights[{i}].{name} is on {getattr(w, name).device}, the activations are on {device}")
        if w.a_rows.shape[0] != w.b_rows.shape[0]:
            _fail(op, f"weights[{i}]: a_rows has {w.a_rows.shape[0]} rows, b_rows has {w.b_rows.shape[0]}")


def check_meta(op: str, meta: LoRABatchMeta, num_tokens: int, weights: Sequence[LoRASliceWeights], device: torch.device) -> None:
    if meta.num_tokens != num_tokens:
        _fail(op, f"meta has {meta.num_tokens} token rows, the activations have {num_tokens}")
    for name in ("token_slots", "sorted_tokens", "seg_slots", "seg_starts"):
        t = getattr(meta, name)
        if t.device != device or t.dtype != torch.int32:
            _fail(op, f"meta.{name} must be int32 on {device}, got {t.dtype} on {t.device}")
    top = max(meta.host_seg_slots, default=-1)
    for i, w in enumerate(weights):
        if top >= w.max_slots:
            _fail(op, f"meta uses slot {top}, weights[{i}] has only {w.max_slots} slots")


def check_shrink(x: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, out: Tensor, op: str = "shrink") -> None:
    if x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES or x.stride(1) != 1:
        _fail(op, f"x must be 2-D [T, in] float16/bfloat16/float32 with unit column stride, got {x.dtype} {tuple(x.shape)}")
    check_weights(op, weights, x.device, x.dtype)
    check_meta(op, meta, x.shape[0], weights, x.device)
    for i, w in enumerate(weights):
        if w.in_features != x.shape[1]:
            _fail(op, f"x has {x.shape[1]} features, weights[{i}] expects {w.in_features}")
    max_rank = max(w.max_rank for w in weights)
    if out.dtype != torch.float32 or out.dim() != 3 or out.device != x.device or out.stride(2) != 1:
        _fail(op, f"out must be a 3-D float32 tensor on {x.device} with unit last stride, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if out.shape[0] < len(weights) or out.shape[1] != x.shape[0] or out.shape[2] < max_rank:
        _fail(op, f"out must be [>= {len(weights)} slices, T={x.shape[0]}, >= max rank {max_rank}], got {tuple(out.shape)}")


def check_expand(
    h: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, y: Tensor, slice_offsets: Sequence[int], op: str = "expand"
) -> None:
    if y.dim() != 2 or y.dtype not in SUPPORTED_DTYPES or y.stride(1) != 1:
        _fail(op, f"y must be 2-D [T, out] float16/bfloat16/float32 with unit column stride, got {y.dtype} {tuple(y.shape)}")
    check_weights(op, weights, y.device, y.dtype)
    check_meta(op, meta, y.shape[0], weights, y.device)
    max_rank = max(w.max_rank for w in weights)
    if h.dtype != torch.float32 or h.dim() != 3 or h.device != y.device or h.stride(2) != 1:
        _fail(op, f"h must be a 3-D float32 tensor on {y.device} with unit last stride, got {h.dtype} {tuple(h.shape)} on {h.device}")
    if h.shape[0] < len(weights) or h.shape[1] != y.shape[0] or h.shape[2] < max_rank:
        _fail(op, f"h must be [>= {len(weights)} slices, T={y.shape[0]}, >= max rank {max_rank}], got {tuple(h.shape)}")
    if len(slice_offsets) != len(weights):
        _fail(op, f"{len(weights)} slices but {len(slice_offsets)} slice_offsets")
    for i, (off, w) in enumerate(zip(slice_offsets, weights)):
        if off < 0 or off + w.out_features > y.shape[1]:
            _fail(op, f"slice {i} at column {off} with {w.out_features} columns exceeds y's {y.shape[1]} columns")
