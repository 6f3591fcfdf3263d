"""Per-token (BGMV) LoRA shrink for decode: each row looks up its own slot.

For every row t with slot ``s = token_slots[t] != -1`` and every slice i with rank
``r = rank_{i,s} > 0``:

    out[i, t, :r] = x[t] @ A_{i,s}^T        A_{i,s} = a_rows_i[start_{i,s} : start_{i,s} + r]

Grid: (row, slice). A decode row is a GEMV (one row against r weight rows), so the
program multiplies a ``[BLOCK_R, BLOCK_K]`` weight tile by the row elementwise and
reduces in fp32 (no ``tl.dot``: a 1-row dot would be padded 16x for nothing, and
the op is bound by reading A). The rank is walked in ``BLOCK_R`` tiles masked to
the slot's own rank. The grid depends only on T and the number of slices, so a
captured CUDA graph stays valid whatever adapters the rows use.
"""
from __future__ import annotations

from typing import Sequence

import triton
import triton.language as tl
from torch import Tensor

from backends.cuda.kernel_config import token_tiles
from backends.cuda.lora_checks import check_grid, check_shrink
from backends.cuda.slice_table import COL_A, COL_RANK, COL_START, TABLE_WIDTH, SliceTable
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights


@triton.jit
def _kernel(
    x_ptr, out_ptr, table_ptr, slots_ptr,
    K, stride_xm, stride_os, stride_ot,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    sid = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot < 0:  # no adapter: this row is left untouched
        return
    entry = table_ptr + sid * TABLE_WIDTH
    rank = tl.load(tl.load(entry + COL_RANK).to(tl.pointer_type(tl.int32)) + slot)
    if rank == 0:
        return
    start = tl.load(tl.load(entry + COL_START).to(tl.pointer_type(tl.int32)) + slot)
    a_ptr = tl.load(entry + COL_A).to(tl.pointer_type(x_ptr.dtype.element_ty))

    offs_k = tl.arange(0, BLOCK_K)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        a_rows = (start + offs_r).to(tl.int64)
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < K
            xv = tl.load(x_ptr + t * stride_xm + k, mask=k_mask, other=0.0).to(tl.float32)
            at = tl.load(a_ptr + a_rows[:, None] * K + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            acc += at.to(tl.float32) * xv[None, :]
        dst = out_ptr + sid.to(tl.int64) * stride_os + t * stride_ot + offs_r
        tl.store(dst, tl.sum(acc, axis=1), mask=r_mask)


def bgmv_shrink(
    x: Tensor,
    weights: Sequence[LoRASliceWeights],
    meta: LoRABatchMeta,
    out: Tensor,
    table: SliceTable | None = None,
) -> None:
    """``out[i, t, :r] = x[t] @ A_{i,slot(t)}^T`` row by row (see module docstring).

    x: [T, in] fp16/bf16/fp32; out: [>= n_slices, T, >= max rank] float32;
    table: the slices' pointer table (built with zero offsets; built here if None).
    """
    zeros = [0] * len(weights)
    table = SliceTable.for_call("bgmv_shrink", weights, zeros, table)
    max_rank = max(w.max_rank for w in weights)
    check_shrink(x, table, meta, out, max_rank, op="bgmv_shrink")
    if x.shape[0] == 0 or max_rank == 0:
        return
    tiles = token_tiles(max_rank, x.shape[1], table.max_out)
    grid = (x.shape[0], len(weights))
    check_grid("bgmv_shrink", grid, lambda: (f"{x.shape[0]} rows", f"{len(weights)} slice(s)"))
    _kernel[grid](
        x, out, table.table, meta.token_slots,
        x.shape[1], x.stride(0), out.stride(0), out.stride(1),
        BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k,
    )
