"""Segment (SGMV) LoRA shrink for prefill: rows grouped by adapter slot.

For every segment g (rows ``sorted_tokens[seg_starts[g] : seg_starts[g+1]]``, all
served by slot ``s = seg_slots[g]``) and every slice i with rank ``r = rank_{i,s} > 0``:

    out[i, t, :r] = x[t] @ A_{i,s}^T        A_{i,s} = a_rows_i[start_{i,s} : start_{i,s} + r]

accumulated in fp32. Grid: (tile, slice), one program per ``meta.seg_tiles`` entry (a
segment's run of at most 64 rows), so a long segment beside short ones launches no idle
programs. Each program gathers its tile's rows (``BLOCK_M`` >= the tile, padded to >= 16
and masked) and walks the
rank in ``BLOCK_R`` tiles (masked to the slot's own rank: no padding of the weights)
and ``in`` in ``BLOCK_K`` tiles. Rows with slot -1 are in no segment; slices where the
slot has rank 0 return before touching memory. Nothing else of ``out`` is written.
"""
from __future__ import annotations

from typing import Sequence

import triton
import triton.language as tl
from torch import Tensor

from backends.cuda.kernel_config import dot_in_fp32, segment_tiles, shrink_warps
from backends.cuda.lora_checks import check_grid, check_shrink, check_tiles
from backends.cuda.slice_table import COL_A, COL_RANK, COL_START, TABLE_WIDTH, SliceTable
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights


@triton.jit
def _kernel(
    x_ptr, out_ptr, table_ptr, sorted_ptr, seg_slots_ptr, seg_starts_ptr, tiles_ptr,
    K, stride_xm, stride_os, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    sid = tl.program_id(1)
    seg = tl.load(tiles_ptr + 2 * tile)
    m0 = tl.load(tiles_ptr + 2 * tile + 1)
    seg_end = tl.minimum(tl.load(seg_starts_ptr + seg + 1), m0 + BLOCK_M)
    slot = tl.load(seg_slots_ptr + seg)
    entry = table_ptr + sid * TABLE_WIDTH
    rank = tl.load(tl.load(entry + COL_RANK).to(tl.pointer_type(tl.int32)) + slot)
    if rank == 0:  # this adapter does not target this slice
        return
    start = tl.load(tl.load(entry + COL_START).to(tl.pointer_type(tl.int32)) + slot)
    a_ptr = tl.load(entry + COL_A).to(tl.pointer_type(x_ptr.dtype.element_ty))

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    rows = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        a_rows = (start + offs_r).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < K
            xt = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptr + a_rows[None, :] * K + k[:, None], mask=r_mask[None, :] & k_mask[:, None], other=0.0)
            if DOT_FP32:
                acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, at)
        dst = out_ptr + sid.to(tl.int64) * stride_os + rows[:, None] * stride_ot + offs_r[None, :]
        tl.store(dst, acc, mask=m_mask[:, None] & r_mask[None, :])


def sgmv_shrink(
    x: Tensor,
    weights: Sequence[LoRASliceWeights],
    meta: LoRABatchMeta,
    out: Tensor,
    table: SliceTable | None = None,
) -> None:
    """``out[i, t, :r] = x[t] @ A_{i,slot(t)}^T`` over segments (see module docstring).

    x: [T, in] fp16/bf16/fp32; out: [>= n_slices, T, >= max rank] float32;
    table: the slices' pointer table (built with zero offsets; built here if None).
    """
    zeros = [0] * len(weights)
    table = SliceTable.for_call("sgmv_shrink", weights, zeros, table)
    max_rank = max(w.max_rank for w in weights)
    check_shrink(x, table, meta, out, max_rank, op="sgmv_shrink")
    if meta.num_segments == 0 or max_rank == 0:
        return
    tiles = segment_tiles(meta.max_seg_len, max_rank, x.shape[1], table.max_out)
    check_tiles(meta, tiles.block_m, op="sgmv_shrink")
    grid = (meta.num_tiles, len(weights))
    check_grid("sgmv_shrink", grid, lambda: (f"{meta.num_tiles} row tiles", f"{len(weights)} slice(s)"))
    _kernel[grid](
        x, out, table.table, meta.sorted_tokens, meta.seg_slots, meta.seg_starts, meta.seg_tiles,
        x.shape[1], x.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k, DOT_FP32=dot_in_fp32(x.dtype),
        num_warps=shrink_warps(tiles),
    )
