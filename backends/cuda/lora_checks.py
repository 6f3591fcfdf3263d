"""Argument checks shared by the LoRA kernel launchers (host metadata only, no device reads).

Every argument a launcher takes is either honoured or rejected here with an error
naming the op, the argument and what was expected. A slice group's weights are
validated once, when its ``SliceTable`` is built; each call then checks only the
activations, the workspace and the batch metadata against the table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import Tensor

from backends.cuda.kernel_config import SUPPORTED_DTYPES
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.op_arguments import check_rows_and_slots, elements_may_share_memory
from runtime.lora.slice_weights import LoRASliceWeights

if TYPE_CHECKING:
    from backends.cuda.slice_table import SliceTable


# CUDA's gridDim maxima (x, y, z). Triton maps program_id(0..2) onto them and does not check
# them; the driver refuses a launch past one with an invalid-argument error naming no shape.
CUDA_GRID_LIMITS = (2**31 - 1, 65535, 65535)


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def check_grid(op: str, grid: Sequence[int], axes: Callable[[], Sequence[str]]) -> None:
    """Every grid axis within CUDA's limit; ``axes()`` says what each axis counts (called only
    to word the error, so a launch formats nothing).

    The launchers' grids (``block_n`` >= 128 once the widest slice is that wide):

        sgmv_shrink  (row tiles, slices)            bgmv_shrink  (rows, slices)
        sgmv_expand  (row tiles, slices x ceil(max_out / block_n))
        bgmv_expand  (rows, slices x ceil(max_out / block_n))

    Axis 1 is the one that can pass 65535: the expand kernels' column blocks, once
    slices x ceil(max_out / block_n) > 65535, e.g. one slice wider than 65535 x 128 =
    8,388,480 columns (block_n is 128 in sgmv_expand; 128, 256 or 512 in bgmv_expand, for
    ranks above 32, above 16, up to 16). LoRA targets stay far below that (a 256k-column
    vocabulary is 2048 blocks), so such a slice is refused here rather than folded into axis 0.
    Axis 0 (rows, or 64-row tiles) would need 2^31 rows; axis 2 is unused. Applied under the
    interpreter too, which has no such limit, so CPU runs refuse what a GPU would.
    """
    for axis, (n, limit) in enumerate(zip(grid, CUDA_GRID_LIMITS)):
        if n > limit:
            what = axes()[axis]
            _fail(op, f"grid axis {axis} would have {n} programs ({what}), above CUDA's limit of {limit} on that axis")


def check_weights(op: str, weights: Sequence[LoRASliceWeights]) -> None:
    """One slice group: same dtype, device and in_features everywhere; dense buffers; one slot table length per slice."""
    if len(weights) == 0:
        _fail(op, "weights is empty; pass one LoRASliceWeights per slice")
    dtype, device, in_features = weights[0].a_rows.dtype, weights[0].a_rows.device, weights[0].in_features
    if dtype not in SUPPORTED_DTYPES:
        _fail(op, f"weights[0].a_rows is {dtype}; supported: float16, bfloat16, float32")
    for i, w in enumerate(weights):
        for name in ("a_rows", "b_rows"):
            t = getattr(w, name)
            if t.dtype != dtype:
                _fail(op, f"weights[{i}].{name} is {t.dtype}, weights[0].a_rows is {dtype}")
            if t.dim() != 2 or not t.is_contiguous():
                _fail(op, f"weights[{i}].{name} must be a contiguous 2-D tensor, got shape {tuple(t.shape)}")
        for name, want in (("slot_start", torch.int32), ("slot_rank", torch.int32), ("slot_scale", torch.float32)):
            t = getattr(w, name)
            if t.dtype != want or t.dim() != 1 or not t.is_contiguous():
                _fail(op, f"weights[{i}].{name} must be a contiguous 1-D {want} tensor, got {t.dtype} {tuple(t.shape)}")
        lengths = {name: getattr(w, name).shape[0] for name in ("slot_start", "slot_rank", "slot_scale")}
        if len(set(lengths.values())) != 1:  # the kernels index all three with any slot below len(slot_rank)
            _fail(op, f"weights[{i}]: slot_start, slot_rank and slot_scale must have one entry per slot, got {lengths}")
        for name in ("a_rows", "b_rows", "slot_start", "slot_rank", "slot_scale"):
            if getattr(w, name).device != device:
                _fail(op, f"weights[{i}].{name} is on {getattr(w, name).device}, weights[0].a_rows on {device}")
        if w.a_rows.shape[0] != w.b_rows.shape[0]:
            _fail(op, f"weights[{i}]: a_rows has {w.a_rows.shape[0]} rows, b_rows has {w.b_rows.shape[0]}")
        if w.in_features != in_features:
            _fail(op, f"weights[{i}] has {w.in_features} in_features, weights[0] has {in_features}: one launch needs one input")


def check_meta(op: str, meta: LoRABatchMeta, num_tokens: int, table: "SliceTable") -> None:
    """``meta`` describes these rows with slots the weights have, and every index array the kernels
    may read (``seg_tiles`` too, when built: the segment kernels' program map) is int32 on the
    weights' device. A missing ``seg_tiles`` is refused by ``check_tiles``, on the segment path only."""
    check_rows_and_slots(op, meta, num_tokens, table.max_slots)
    for name in ("token_slots", "sorted_tokens", "seg_slots", "seg_starts", "seg_tiles"):
        t = getattr(meta, name)
        if t is None:
            continue
        if t.device != table.device or t.dtype != torch.int32:
            _fail(op, f"meta.{name} must be int32 on {table.device}, got {t.dtype} on {t.device}")


def check_shrink(x: Tensor, table: "SliceTable", meta: LoRABatchMeta, out: Tensor, max_rank: int, op: str = "shrink") -> None:
    """Activations against a slice table whose weights were validated when it was built."""
    if x.dim() != 2 or x.stride(1) != 1:
        _fail(op, f"x must be 2-D [T, in] with unit column stride, got shape {tuple(x.shape)} strides {x.stride()}")
    if x.dtype != table.dtype or x.device != table.device:
        _fail(op, f"x is {x.dtype} on {x.device}, the weights are {table.dtype} on {table.device}")
    if x.shape[1] != table.in_features:
        _fail(op, f"x has {x.shape[1]} features, the weights expect {table.in_features}")
    check_meta(op, meta, x.shape[0], table)
    if out.dtype != torch.float32 or out.dim() != 3 or out.device != x.device or out.stride(2) != 1:
        _fail(op, f"out must be a 3-D float32 tensor on {x.device} with unit last stride, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if out.shape[0] < table.n_slices or out.shape[1] != x.shape[0] or out.shape[2] < max_rank:
        _fail(op, f"out must be [>= {table.n_slices} slices, T={x.shape[0]}, >= max rank {max_rank}], got {tuple(out.shape)}")
    if elements_may_share_memory(out):  # several programs would write one element (a race on a GPU)
        _fail(op, f"out's elements share memory (shape {tuple(out.shape)}, strides {out.stride()}); pass a tensor with its own memory per element")


def check_expand(h: Tensor, table: "SliceTable", meta: LoRABatchMeta, y: Tensor, max_rank: int, op: str = "expand") -> None:
    """Activations against a slice table whose weights and offsets were validated when it was built."""
    if y.dim() != 2 or y.stride(1) != 1:
        _fail(op, f"y must be 2-D [T, out] with unit column stride, got shape {tuple(y.shape)} strides {y.stride()}")
    if y.dtype != table.dtype or y.device != table.device:
        _fail(op, f"y is {y.dtype} on {y.device}, the weights are {table.dtype} on {table.device}")
    if elements_may_share_memory(y):  # rows of one memory: each row's load-add-store would race with the others'
        _fail(op, f"y's rows share memory (shape {tuple(y.shape)}, strides {y.stride()}); pass a tensor with its own memory per row")
    if y.shape[1] < table.y_width:
        _fail(op, f"the slices at offsets {table.offsets} need {table.y_width} columns, y has {y.shape[1]}")
    if not table.disjoint:  # the kernels' load-add-store of shared columns would race on a GPU
        _fail(op, f"the slices' columns overlap in y (offsets {table.offsets}); each slice needs its own columns")
    check_meta(op, meta, y.shape[0], table)
    if h.dtype != torch.float32 or h.dim() != 3 or h.device != y.device or h.stride(2) != 1:
        _fail(op, f"h must be a 3-D float32 tensor on {y.device} with unit last stride, got {h.dtype} {tuple(h.shape)} on {h.device}")
    if h.shape[0] < table.n_slices or h.shape[1] != y.shape[0] or h.shape[2] < max_rank:
        _fail(op, f"h must be [>= {table.n_slices} slices, T={y.shape[0]}, >= max rank {max_rank}], got {tuple(h.shape)}")


def check_tiles(meta: LoRABatchMeta, block_m: int, op: str) -> None:
    """The segment kernels run one program per ``meta.seg_tiles`` entry, whose rows must fit
    one ``block_m`` block: tiles hold at most SEGMENT_TILE_ROWS rows, and only segments that
    short when ``block_m`` is smaller."""
    from runtime.lora.batch_meta import SEGMENT_TILE_ROWS

    if meta.seg_tiles is None:
        _fail(op, "meta has no seg_tiles; build it with LoRABatchMeta.build")
    if block_m < min(SEGMENT_TILE_ROWS, meta.max_seg_len):
        _fail(op, f"row block {block_m} is smaller than a tile ({min(SEGMENT_TILE_ROWS, meta.max_seg_len)} rows)")
