"""A random paged-attention step and its dense float64 reference.

Sequences with block tables drawn from a shuffled block pool (non-contiguous), GQA
(``Hq = 2 * Hkv``), a mix of a full prefill, a decode token and a prefill chunk after
history. The cache holds random history; the step writes its new K/V at
``slot_mapping`` and attends causally. Reference, per sequence b and query row i
(position p_i = ctx_b - q_len_b + i), query head j, kv head j // (Hq / Hkv):

    out[i, j] = softmax(scale * q_i,j . K[0..p_i, kv(j)]^T) @ V[0..p_i, kv(j)]      (float64)

``scale`` is drawn in [0.3, 0.6] / sqrt(HEAD_DIM), never SDPA's default 1 / sqrt(head_dim), so an
attention that drops the caller's scale (a model with a query_pre_attn_scalar, e.g.) fails.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from runtime.kv.attention_meta import AttentionMeta
from runtime.verifiers.numerics import compare, unchanged
from runtime.verifiers.result import VerificationFailure

HQ, HKV, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 4
# Softmax and two matmuls round several times in the compute dtype.
ATTENTION_TOL_SCALE = 4.0


@dataclass(frozen=True)
class AttentionStep:
    q: Tensor
    k: Tensor
    v: Tensor
    meta: AttentionMeta
    scale: float


def random_cache(num_blocks: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> Tensor:
    return torch.randn(2, num_blocks * BLOCK_SIZE, HKV, HEAD_DIM, generator=g, dtype=torch.float64).to(dtype).to(device)


def random_step(query_lens: Sequence[int], context_lens: Sequence[int], tables: Sequence[Sequence[int]],
                dtype: torch.dtype, device: torch.device, g: torch.Generator) -> AttentionStep:
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, HEAD_DIM, generator=g, dtype=torch.float64).to(dtype).to(device) for h in (HQ, HKV, HKV))
    meta = AttentionMeta.build(query_lens, context_lens, tables, BLOCK_SIZE, device)
    scale = float(0.3 + 0.3 * torch.rand((), generator=g, dtype=torch.float64)) * HEAD_DIM**-0.5
    return AttentionStep(q, k, v, meta, scale=scale)


def dense_reference(step: AttentionStep, cache_before: Tensor) -> tuple[Tensor, Tensor]:
    """(attention output [T, Hq, D] float64, the cache after the step's writes, float64)."""
    cache = cache_before.detach().cpu().double().clone()
    slots = step.meta.slot_mapping.cpu().long()
    cache[0, slots] = step.k.cpu().double()
    cache[1, slots] = step.v.cpu().double()
    q = step.q.cpu().double()
    out = torch.empty_like(q)
    qs, bs = step.meta.host_query_starts, BLOCK_SIZE
    for b, ctx in enumerate(step.meta.host_context_lens):
        table = step.meta.host_block_tables[b]
        idx = torch.tensor([table[j // bs] * bs + j % bs for j in range(ctx)])
        keys, vals = cache[0, idx], cache[1, idx]  # [ctx, Hkv, D]
        q_len = qs[b + 1] - qs[b]
        for i in range(q_len):
            pos = ctx - q_len + i
            for j in range(HQ):
                kv = j // (HQ // HKV)
                logits = step.scale * (keys[: pos + 1, kv] @ q[qs[b] + i, j])
                out[qs[b] + i, j] = torch.softmax(logits, 0) @ vals[: pos + 1, kv]
    return out, cache


def check_attention(backend: Any, step: AttentionStep, cache: Tensor, dtype: torch.dtype, tag: str) -> dict[str, float]:
    """Run ``paged_attention`` in place on ``cache``; check output, the writes, and nothing else written."""
    ref_out, ref_cache = dense_reference(step, cache)
    before = cache.detach().cpu().clone()
    out = backend.attention.paged_attention(step.q, step.k, step.v, cache, step.meta, step.scale)
    backend.synchronize()
    if out.dtype != step.q.dtype:
        raise VerificationFailure(f"paged_attention ({tag}): output dtype {out.dtype} != query dtype {step.q.dtype}")
    err = compare(f"paged_attention ({tag})", out, ref_out, dtype, scale=ATTENTION_TOL_SCALE)
    after = cache.detach().cpu()
    written = torch.zeros(after.shape[1], dtype=torch.bool)
    written[step.meta.slot_mapping.cpu().long()] = True
    compare(f"paged_attention ({tag}): K/V written to the cache", after[:, written], ref_cache[:, written], dtype)
    unchanged(f"paged_attention ({tag}): cache entries outside slot_mapping", after[:, ~written], before[:, ~written])
    return err
