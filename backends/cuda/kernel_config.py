"""Tile sizes and dot-precision flags for the LoRA kernels, chosen on the host.

No autotuning: autotune needs a driver (it cannot run under ``TRITON_INTERPRET=1``)
and its first call times kernels, which must not happen inside CUDA-graph capture.
Tile sizes only change speed, never results: every kernel loops over the rank at run
time, so a tile chosen for one set of resident adapters stays correct for any other.

Every ``tl.dot`` dimension is >= 16 (the GPU compiler rejects smaller tiles).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_DOT = 16  # smallest tl.dot tile the GPU compiler accepts
MAX_RANK_TILE = 64  # ranks above this loop over rank tiles inside the kernel
TILE_ELEMENTS = 8192  # elements of the per-token kernels' weight tile (register budget)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def clamp_pow2(n: int, low: int, high: int) -> int:
    return max(low, min(high, next_pow2(n)))


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands are upcast to fp32 (with ``input_precision="ieee"``).

    fp32 inputs: always, so results match the fp32 reference tightly (no TF32).
    bf16 inputs under the interpreter: the interpreter multiplies bf16's raw uint16
    bits in ``tl.dot`` and returns garbage, so operands are upcast first. On a GPU
    bf16/fp16 use the tensor cores natively with fp32 accumulation.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


@dataclass(frozen=True)
class SegmentTiles:
    """Tiles of the segment (SGMV) kernels: rows x rank x (K for shrink | N for expand)."""

    block_m: int
    block_r: int
    block_k: int
    block_n: int


@dataclass(frozen=True)
class TokenTiles:
    """Tiles of the per-token (BGMV) kernels: rank x (K for shrink | N for expand)."""

    block_r: int
    block_k: int
    block_n: int


def segment_tiles(max_seg_len: int, max_rank: int, in_features: int, max_out: int) -> SegmentTiles:
    return SegmentTiles(
        block_m=clamp_pow2(max_seg_len, MIN_DOT, 64),
        block_r=clamp_pow2(max_rank, MIN_DOT, MAX_RANK_TILE),
        block_k=clamp_pow2(in_features, MIN_DOT, 64),
        block_n=clamp_pow2(max_out, MIN_DOT, 128),
    )


def expand_warps(tiles: SegmentTiles) -> int:
    """Warps for sgmv_expand: 8 for the largest tiles (64 x 128 outputs), 4 (Triton's default) below.

    Compiled for sm_90 with Triton 3.9's ptxas (no GPU run), the 64 x 64 x 128 tile at 4 warps
    needs 255 registers and spills (64 B of stack in fp16, 208 B in fp32); at 8 warps it
    takes 196 / 182 registers and spills nothing. The kernels ran on an H200 (2026-11-30); the warp
    counts were not timed against each other there."""
    return 8 if tiles.block_m * tiles.block_n >= 64 * 128 else 4


def shrink_warps(tiles: SegmentTiles) -> int:
    """Warps for sgmv_shrink: 8 for the 64 x 64 (rows x rank) tile, 4 below. Compiled for sm_90
    (Triton 3.9's ptxas, no GPU run), fp32 at 4 warps needs 255 registers and spills 88 B; at
    8, 162 registers (fp16: 246 -> 128) and no spill. Ran on an H200 (2026-11-30); the warp counts
    were not timed against each other there."""
    return 8 if tiles.block_m * tiles.block_r >= 64 * 64 else 4


def token_tiles(max_rank: int, in_features: int, max_out: int) -> TokenTiles:
    block_r = clamp_pow2(max_rank, MIN_DOT, MAX_RANK_TILE)
    wide = TILE_ELEMENTS // block_r
    return TokenTiles(
        block_r=block_r,
        block_k=clamp_pow2(in_features, MIN_DOT, wide),
        block_n=clamp_pow2(max_out, MIN_DOT, wide),
    )
