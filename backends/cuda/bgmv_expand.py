"""Per-token (BGMV) LoRA expand for decode, all slices of a layer in one launch.

For every row t with slot ``s = token_slots[t] != -1`` and every slice i with rank
``r = rank_{i,s} > 0``:

    y[t, o_i : o_i + n_i] += scale_{i,s} * h[i, t, :r] @ B_{i,s}^T
                              B_{i,s}^T = b_rows_i[start_{i,s} : start_{i,s} + r]

in fp32, rounded once to ``y``'s dtype. Grid: (row, slice x column block); a column
block past its slice's width returns at once. Each program multiplies a
``[BLOCK_R, BLOCK_N]`` tile of B^T by the row's ``h`` elementwise and reduces over
the rank in fp32, walking the rank in tiles masked to the slot's own rank (so
entries of ``h`` past it are never read). The grid depends on T, the slices' widths
and, through the column tile (``token_tiles``), the largest rank resident at launch; the
kernel walks each slot's own rank at run time, so a launch captured in a CUDA graph stays
correct whatever adapters the rows use on replay.
"""
from __future__ import annotations

from typing import Sequence

import triton
import triton.language as tl
from torch import Tensor

from backends.cuda.kernel_config import token_tiles
from backends.cuda.lora_checks import check_expand, check_grid
from backends.cuda.slice_table import COL_B, COL_OFFSET, COL_OUT, COL_RANK, COL_SCALE, COL_START, TABLE_WIDTH, SliceTable
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights


@triton.jit
def _kernel(
    h_ptr, y_ptr, table_ptr, slots_ptr,
    n_col_blocks, stride_hs, stride_ht, stride_ym,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    sid = tl.program_id(1) // n_col_blocks
    n_block = tl.program_id(1) % n_col_blocks
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    entry = table_ptr + sid * TABLE_WIDTH
    n_out = tl.load(entry + COL_OUT)
    n0 = n_block * BLOCK_N
    if n0 >= n_out:
        return
    rank = tl.load(tl.load(entry + COL_RANK).to(tl.pointer_type(tl.int32)) + slot)
    if rank == 0:
        return
    start = tl.load(tl.load(entry + COL_START).to(tl.pointer_type(tl.int32)) + slot)
    scale = tl.load(tl.load(entry + COL_SCALE).to(tl.pointer_type(tl.float32)) + slot)
    b_ptr = tl.load(entry + COL_B).to(tl.pointer_type(y_ptr.dtype.element_ty))
    col_offset = tl.load(entry + COL_OFFSET)

    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    h_row = h_ptr + sid.to(tl.int64) * stride_hs + t * stride_ht
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        hv = tl.load(h_row + offs_r, mask=r_mask, other=0.0)
        b_rows = (start + offs_r).to(tl.int64)
        bt = tl.load(b_ptr + b_rows[:, None] * n_out + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.sum(bt.to(tl.float32) * hv[:, None], axis=0)
    dst = y_ptr + t * stride_ym + col_offset + offs_n
    old = tl.load(dst, mask=n_mask, other=0.0)
    tl.store(dst, (old.to(tl.float32) + scale * acc).to(old.dtype), mask=n_mask)


def bgmv_expand(
    h: Tensor,
    weights: Sequence[LoRASliceWeights],
    meta: LoRABatchMeta,
    y: Tensor,
    slice_offsets: Sequence[int],
    table: SliceTable | None = None,
) -> None:
    """``y[t, o_i:o_i+n_i] += scale * h[i, t, :r] @ B_{i,slot(t)}^T`` row by row, in place.

    h: [>= n_slices, T, >= max rank] float32; y: [T, total_out] in the weights' dtype;
    slice_offsets: first column of each slice in y; table: built with these offsets.
    """
    table = SliceTable.for_call("bgmv_expand", weights, slice_offsets, table)
    max_rank = max(w.max_rank for w in weights)
    check_expand(h, table, meta, y, max_rank, op="bgmv_expand")
    if y.shape[0] == 0 or max_rank == 0:
        return
    tiles = token_tiles(max_rank, weights[0].in_features, table.max_out)
    n_col_blocks = triton.cdiv(table.max_out, tiles.block_n)
    grid = (y.shape[0], len(weights) * n_col_blocks)
    check_grid("bgmv_expand", grid, lambda: (f"{y.shape[0]} rows",
                                     f"{len(weights)} slice(s) x {n_col_blocks} column blocks of {tiles.block_n}; the widest slice is {table.max_out} columns wide"))
    _kernel[grid](
        h, y, table.table, meta.token_slots,
        n_col_blocks, h.stride(0), h.stride(1), y.stride(0),
        BLOCK_R=tiles.block_r, BLOCK_N=tiles.block_n,
    )
