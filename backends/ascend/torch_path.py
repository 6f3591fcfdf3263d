"""The declared fallback: plain torch ops on the backend's device, fp32 accumulate.

Two schedules, both device-generic (no host reads):

- segments (prefill): per segment of rows sharing slot s,
      h[rows, :r]          = x[rows] @ A_s^T
      y[rows, off:off+out] += scale_s * h[rows, :r] @ B_s^T
  one matmul per segment, row offsets from the host mirrors;
- gather (decode): per row t, gather its slot's rank-padded weights and ``bmm``:
      A_pad[t] = a_rows[start_t + k] for k < r_t else 0      [T, pad, in]
      h[t]     = A_pad[t] @ x[t]
      y[t]    += scale_t * B_pad[t]^T-rows @ h[t]
  where ``slots[t] = -1`` marks rows this call must leave alone.
"""
from __future__ import annotations

import torch
from torch import Tensor

from backends.ascend.segment_plan import Segment
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights


def shrink_segments(x: Tensor, weights: LoRASliceWeights, segments: list[Segment], meta: LoRABatchMeta, out_i: Tensor) -> None:
    for seg in segments:
        r, start = weights.host_rank[seg.slot], weights.host_start[seg.slot]
        rows = meta.sorted_tokens[seg.begin : seg.end].long()
        a = weights.a_rows[start : start + r].float()
        out_i[rows, :r] = (x.index_select(0, rows).float() @ a.t()).to(out_i.dtype)


def expand_segments(
    h_i: Tensor, weights: LoRASliceWeights, segments: list[Segment], meta: LoRABatchMeta, y: Tensor, offset: int
) -> None:
    cols = slice(offset, offset + weights.out_features)
    for seg in segments:
        r, start = weights.host_rank[seg.slot], weights.host_start[seg.slot]
        rows = meta.sorted_tokens[seg.begin : seg.end].long()
        b_t = weights.b_rows[start : start + r].float()
        delta = weights.host_scale[seg.slot] * (h_i.index_select(0, rows)[:, :r].float() @ b_t)
        y[rows, cols] = (y[rows, cols].float() + delta).to(y.dtype)


def _padded_rows(weights: LoRASliceWeights, slots: Tensor, pad: int) -> tuple[Tensor, Tensor]:
    """(row index [T, pad] into the flat buffers, validity mask [T, pad])."""
    safe = slots.clamp(min=0).long()
    start = weights.slot_start.long().index_select(0, safe)
    rank = weights.slot_rank.long().index_select(0, safe) * (slots >= 0).long()
    k = torch.arange(pad, device=slots.device)
    valid = k[None, :] < rank[:, None]
    index = torch.where(valid, start[:, None] + k[None, :], torch.zeros_like(valid, dtype=torch.int64))
    return index, valid


def shrink_gather(x: Tensor, weights: LoRASliceWeights, slots: Tensor, pad: int, out_i: Tensor) -> None:
    """``out_i[t, :r_t] = x[t] @ A_{slot_t}^T`` for rows with ``slots[t] >= 0``."""
    index, valid = _padded_rows(weights, slots, pad)
    a = weights.a_rows[index].float() * valid[..., None]  # [T, pad, in]
    h = torch.bmm(a, x.float()[:, :, None])[:, :, 0]  # [T, pad]
    out_i[:, :pad] = torch.where(valid, h.to(out_i.dtype), out_i[:, :pad])


def expand_gather(h_i: Tensor, weights: LoRASliceWeights, slots: Tensor, pad: int, y: Tensor, offset: int) -> None:
    """``y[t, off:off+out] += scale_t * h_i[t, :r_t] @ B_{slot_t}^T`` for rows with ``slots[t] >= 0``."""
    index, valid = _padded_rows(weights, slots, pad)
    b_t = weights.b_rows[index].float() * valid[..., None]  # [T, pad, out]
    has = slots >= 0
    scale = weights.slot_scale.index_select(0, slots.clamp(min=0).long()) * has
    h = torch.where(valid, h_i[:, :pad].float(), torch.zeros_like(h_i[:, :pad], dtype=torch.float32))
    delta = torch.bmm(h[:, None, :], b_t)[:, 0, :] * scale[:, None]
    cols = slice(offset, offset + weights.out_features)
    y[:, cols] = torch.where(has[:, None], (y[:, cols].float() + delta).to(y.dtype), y[:, cols])


def keep_slots(token_slots: Tensor, slots: list[int], max_slots: int) -> Tensor:
    """``token_slots`` with every slot not in ``slots`` replaced by -1 (device op, host table)."""
    table = [-1] * max_slots
    for slot in slots:
        table[slot] = slot
    lookup = torch.tensor(table, dtype=token_slots.dtype, device=token_slots.device)
    picked = lookup.index_select(0, token_slots.clamp(min=0).long())
    return torch.where(token_slots >= 0, picked, torch.full_like(picked, -1))
