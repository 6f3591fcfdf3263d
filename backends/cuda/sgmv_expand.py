"""Segment (SGMV) LoRA expand for prefill, all slices of a layer in one launch.

For every segment g (rows served by slot ``s = seg_slots[g]``), every slice i with
rank ``r = rank_{i,s} > 0``, and every row t of the segment:

    y[t, o_i : o_i + n_i] += scale_{i,s} * h[i, t, :r] @ B_{i,s}^T
                              B_{i,s}^T = b_rows_i[start_{i,s} : start_{i,s} + r]

with fp32 accumulation and one rounding to ``y``'s dtype. Grid: (tile, slice x column
block), one program per ``meta.seg_tiles`` entry (a segment's run of at most 64 rows); a
column block past its slice's width returns at once.
The rank (the reduction) is walked in ``BLOCK_R`` tiles masked to the slot's own
rank, so entries of ``h`` past it are never read.

Numerics of the dot. fp32 runs (and bf16 in the interpreter) dot in fp32 with
``input_precision="ieee"``. On a GPU, fp16/bf16 runs cast the fp32 ``h`` tile to the
weights' dtype for a tensor-core dot with fp32 accumulation (as vLLM does), which rounds
``h`` to 2^-11 (fp16) or 2^-8 (bf16) relative precision. bf16 has fp32's exponent range, so
the cast cannot overflow. fp16 tops out at 65504, and ``|h|`` can pass it (large activations
times an A of large norm) while ``scale * h @ B^T`` fits, so fp16 runs scale each
``[BLOCK_M, BLOCK_R]`` tile ``H`` of ``h`` by a power of two before the cast
(``_fp16_tile_scale``):

    m = max |H|       s = 1                       if m <= 65504       (finite entries only)
                      s = 2^(floor(log2 m) - 14)  otherwise
    acc = s * (acc / s + fp16(H / s) @ B_tile)

The dot takes ``acc`` as its accumulator operand (``tl.dot(a, b, acc)``), so no second
register tile holds its result. With ``s`` a power of two, the divisions and the
multiplication are exact in fp32 (short of fp32 underflow), and the scaled tile's max lies in
[2^14, 2^15): every entry is rounded to fp16 once, to 2^-11 relative, as without scaling,
except that an entry below 2^-14 * s becomes subnormal or zero in fp16 (an absolute error of
at most 2^-25 * s, under 2^-39 of the tile's max). Tiles that fit take ``s = 1``, and
multiplying by 1 is exact, so they get bit for bit ``tl.dot(fp16(H), B_tile, acc)``. The dot
stays one fp16 tensor-core dot; the added work per rank tile is a tile max, a select, and
multiplies of ``H`` and (twice) of ``acc``. One scale per tile, not per row: per row needed
more registers (compiled for sm_90, 64 x 16 x 128 at 8 warps: 224 against 212; 32 x 64 x 128
at 4 warps spilled 8 bytes) for no gain beyond the 2^-39 above. Not timed, and not run on a
GPU: the guard ran only under Triton's interpreter (docs/platforms.md). The per-token kernel
keeps ``h`` in fp32 and needs none.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.cuda.kernel_config import dot_in_fp32, expand_warps, segment_tiles
from backends.cuda.lora_checks import check_expand, check_grid, check_tiles
from backends.cuda.slice_table import COL_B, COL_OFFSET, COL_OUT, COL_RANK, COL_SCALE, COL_START, TABLE_WIDTH, SliceTable
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights


FP16_MAX = tl.constexpr(65504.0)
FP32_MAX = tl.constexpr(3.4028234663852886e38)
EXPONENT_BITS = tl.constexpr(0x7F800000)  # of a float32: keeping only them rounds down to a power of two


@triton.jit
def _fp16_tile_scale(ht):
    """For the fp32 tile ``ht``: 1.0 when its max finite ``|h|`` fits fp16, else the power of two
    2^(e - 14), with 2^e <= max < 2^(e + 1), that brings the max into [2^14, 2^15).

    inf and NaN entries do not count: an inf max would make the scale inf, and then
    ``acc * (1 / s) * s`` is ``0 * inf``, NaN in every row of the tile, i.e. in the other
    requests of the segment too; left out, they stay inf/NaN in their own row only, as without
    the scaling."""
    abs_h = tl.abs(ht)
    tile_max = tl.max(tl.max(tl.where(abs_h <= FP32_MAX, abs_h, 0.0), axis=1), axis=0)
    floor_pow2 = (tile_max.to(tl.int32, bitcast=True) & EXPONENT_BITS).to(tl.float32, bitcast=True)
    return tl.where(tile_max > FP16_MAX, floor_pow2 * (1.0 / 16384.0), 1.0)


@triton.jit
def _kernel(
    h_ptr, y_ptr, table_ptr, sorted_ptr, seg_slots_ptr, seg_starts_ptr, tiles_ptr,
    n_col_blocks, stride_hs, stride_ht, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    H_TO_FP16: tl.constexpr,
):
    tile = tl.program_id(0)
    sid = tl.program_id(1) // n_col_blocks
    n_block = tl.program_id(1) % n_col_blocks
    seg = tl.load(tiles_ptr + 2 * tile)
    m0 = tl.load(tiles_ptr + 2 * tile + 1)
    seg_end = tl.minimum(tl.load(seg_starts_ptr + seg + 1), m0 + BLOCK_M)
    entry = table_ptr + sid * TABLE_WIDTH
    n_out = tl.load(entry + COL_OUT)
    n0 = n_block * BLOCK_N
    if n0 >= n_out:  # column blocks are sized for the widest slice
        return
    slot = tl.load(seg_slots_ptr + seg)
    rank = tl.load(tl.load(entry + COL_RANK).to(tl.pointer_type(tl.int32)) + slot)
    if rank == 0:
        return
    start = tl.load(tl.load(entry + COL_START).to(tl.pointer_type(tl.int32)) + slot)
    scale = tl.load(tl.load(entry + COL_SCALE).to(tl.pointer_type(tl.float32)) + slot)
    b_ptr = tl.load(entry + COL_B).to(tl.pointer_type(y_ptr.dtype.element_ty))
    col_offset = tl.load(entry + COL_OFFSET)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    rows = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    h_base = h_ptr + sid.to(tl.int64) * stride_hs + rows[:, None] * stride_ht
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        ht = tl.load(h_base + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b_rows = (start + offs_r).to(tl.int64)
        bt = tl.load(b_ptr + b_rows[:, None] * n_out + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(ht, bt.to(tl.float32), input_precision="ieee")
        elif H_TO_FP16:  # keep |h| under fp16's max (module docstring)
            tile_scale = _fp16_tile_scale(ht)
            inv_scale = 1.0 / tile_scale
            acc = tl.dot((ht * inv_scale).to(bt.dtype), bt, acc * inv_scale) * tile_scale
        else:
            acc += tl.dot(ht.to(bt.dtype), bt)
    mask = m_mask[:, None] & n_mask[None, :]
    dst = y_ptr + rows[:, None] * stride_ym + (col_offset + offs_n)[None, :]
    old = tl.load(dst, mask=mask, other=0.0)
    tl.store(dst, (old.to(tl.float32) + scale * acc).to(old.dtype), mask=mask)


def sgmv_expand(
    h: Tensor,
    weights: Sequence[LoRASliceWeights],
    meta: LoRABatchMeta,
    y: Tensor,
    slice_offsets: Sequence[int],
    table: SliceTable | None = None,
) -> None:
    """``y[t, o_i:o_i+n_i] += scale * h[i, t, :r] @ B_{i,slot(t)}^T`` over segments, in place.

    h: [>= n_slices, T, >= max rank] float32; y: [T, total_out] in the weights' dtype;
    slice_offsets: first column of each slice in y; table: built with these offsets.
    """
    table = SliceTable.for_call("sgmv_expand", weights, slice_offsets, table)
    max_rank = max(w.max_rank for w in weights)
    check_expand(h, table, meta, y, max_rank, op="sgmv_expand")
    if meta.num_segments == 0 or max_rank == 0:
        return
    tiles = segment_tiles(meta.max_seg_len, max_rank, weights[0].in_features, table.max_out)
    check_tiles(meta, tiles.block_m, op="sgmv_expand")
    n_col_blocks = triton.cdiv(table.max_out, tiles.block_n)
    grid = (meta.num_tiles, len(weights) * n_col_blocks)
    check_grid("sgmv_expand", grid, lambda: (f"{meta.num_tiles} row tiles",
                                     f"{len(weights)} slice(s) x {n_col_blocks} column blocks of {tiles.block_n}; the widest slice is {table.max_out} columns wide"))
    _kernel[grid](
        h, y, table.table, meta.sorted_tokens, meta.seg_slots, meta.seg_starts, meta.seg_tiles,
        n_col_blocks, h.stride(0), h.stride(1), y.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_R=tiles.block_r, BLOCK_N=tiles.block_n, DOT_FP32=dot_in_fp32(y.dtype),
        H_TO_FP16=y.dtype == torch.float16, num_warps=expand_warps(tiles),
    )
