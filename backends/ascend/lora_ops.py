"""``LoRAOps`` for Ascend: picks, per call and per (slice, rank bucket), the torch_npu op
or the declared plain-torch fallback.

    prefill (meta.decode_only False):  npu_grouped_matmul, rank-bucketed (grouped_matmul.py)
                                       where its documented limits hold, else torch_path segments
    decode  via ``apply``:             npu_batch_gather_matmul_ (fused shrink+expand, batch_gather.py)
                                       where fp16, rank in 16..128 step 16, H % 16 == 0,
                                       out < y width, Atlas A2; else torch_path gather
    decode  via ``shrink``/``expand``: torch_path gather. The fused op needs x and y in one
                                       call, which only ``apply`` has.

Every fallback is declared in capability_matrix.yaml and noted in the backend's
``FallbackLog`` (counted always, logged once per reason). Planning reads host mirrors
only; no call here reads device memory back.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from backends.ascend import batch_gather, grouped_matmul, torch_path
from backends.ascend.fallback_log import FallbackLog
from backends.ascend.segment_plan import Segment, rank_buckets, split_calls
from backends.ascend.soc import SocFamily
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.op_arguments import check_expand, check_shrink
from runtime.lora.slice_weights import LoRASliceWeights


class AscendLoRAOps:
    """See module docstring. ``npu_ops`` provides ``npu_grouped_matmul`` and ``npu_batch_gather_matmul_``."""

    def __init__(self, npu_ops, soc: SocFamily, fallbacks: FallbackLog) -> None:
        self._ops = npu_ops
        self._soc = soc
        self._fallbacks = fallbacks

    # -- LoRAOps protocol ------------------------------------------------------------
    def shrink(self, x: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, out: Tensor) -> None:
        """``out[i, t, :r] = x[t] @ A_{i,slot(t)}^T`` (rows with a slot and r > 0 only)."""
        _check_shrink(x, weights, meta, out)
        if meta.decode_only:
            self._note_split_decode()
            for i, w in enumerate(weights):
                if w.max_rank:
                    torch_path.shrink_gather(x, w, meta.token_slots, w.max_rank, out[i])
            return
        for i, w in enumerate(weights):
            self._shrink_segments(x, w, meta, out[i])

    def expand(
        self, h: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, y: Tensor, slice_offsets: Sequence[int]
    ) -> None:
        """``y[t, o_i:o_i+n_i] += scale * h[i, t, :r] @ B_{i,slot(t)}^T`` in place."""
        check_expand(h, weights, meta, y, slice_offsets)
        if meta.decode_only:
            self._note_split_decode()
            for i, w in enumerate(weights):
                if w.max_rank:
                    torch_path.expand_gather(h[i], w, meta.token_slots, w.max_rank, y, slice_offsets[i])
            return
        for i, w in enumerate(weights):
            self._expand_segments(h[i], w, meta, y, slice_offsets[i])

    # -- fused entry point --------------------------------------------------------------
    def apply(
        self,
        x: Tensor,
        y: Tensor,
        weights: Sequence[LoRASliceWeights],
        meta: LoRABatchMeta,
        slice_offsets: Sequence[int],
        workspace: Tensor,
    ) -> None:
        """``y += LoRA(x)`` for every slice (same contract as ``runtime.backend_api.apply_lora``).

        Decode steps use the fused op per (slice, rank bucket) where allowed; the rest
        (and prefill steps) go through shrink into ``workspace`` then expand.
        """
        if not meta.has_lora:
            return
        t = x.shape[0]
        h = workspace[: len(weights), :t]
        if not meta.decode_only:
            self.shrink(x, weights, meta, h)
            self.expand(h, weights, meta, y, slice_offsets)
            return
        _check_shrink(x, weights, meta, h)
        check_expand(h, weights, meta, y, slice_offsets)
        for i, w in enumerate(weights):
            self._decode_slice(x, y, w, meta, slice_offsets[i], h[i])

    # -- prefill ------------------------------------------------------------------------
    def _shrink_segments(self, x: Tensor, w: LoRASliceWeights, meta: LoRABatchMeta, out_i: Tensor) -> None:
        fallback: list[Segment] = []
        for rank, segments in sorted(rank_buckets(w, meta).items()):
            if self._prefill_blocked(x.dtype, w.in_features, rank):
                fallback.extend(segments)
                continue
            for call in split_calls(rank, segments):
                grouped_matmul.shrink_call(self._ops, x, w, call, grouped_matmul.call_rows(meta, call), out_i)
        torch_path.shrink_segments(x, w, fallback, meta, out_i)

    def _expand_segments(self, h_i: Tensor, w: LoRASliceWeights, meta: LoRABatchMeta, y: Tensor, offset: int) -> None:
        fallback: list[Segment] = []
        for rank, segments in sorted(rank_buckets(w, meta).items()):
            if self._prefill_blocked(w.b_rows.dtype, rank, w.out_features):
                fallback.extend(segments)
                continue
            for call in split_calls(rank, segments):
                grouped_matmul.expand_call(self._ops, h_i, w, call, grouped_matmul.call_rows(meta, call), y, offset)
        torch_path.expand_segments(h_i, w, fallback, meta, y, offset)

    def _prefill_blocked(self, dtype: torch.dtype, k: int, n: int) -> bool:
        reason = grouped_matmul.unsupported_reason(self._soc, dtype, k, n)
        if reason is not None:
            self._fallbacks.note(*reason)
        return reason is not None

    # -- decode -------------------------------------------------------------------------
    def _decode_slice(self, x: Tensor, y: Tensor, w: LoRASliceWeights, meta: LoRABatchMeta, offset: int, h_i: Tensor) -> None:
        buckets: dict[int, list[int]] = {}
        for slot in meta.host_seg_slots:
            rank = w.host_rank[slot]
            if rank > 0:
                buckets.setdefault(rank, []).append(slot)
        torch_slots: list[int] = []
        for rank, slots in sorted(buckets.items()):
            reason = batch_gather.unsupported_reason(
                self._soc, (x.dtype, y.dtype, w.a_rows.dtype, w.b_rows.dtype), rank, w.in_features, w.out_features, y.shape[1],
                y.is_contiguous(),
            )
            if reason is None:
                batch_gather.apply_bucket(self._ops, x, y, w, slots, rank, meta.token_slots, offset)
            else:
                self._fallbacks.note(*reason)
                torch_slots.extend(slots)
        if torch_slots:
            pad = max(w.host_rank[s] for s in torch_slots)
            slots_t = torch_path.keep_slots(meta.token_slots, torch_slots, w.max_slots)
            torch_path.shrink_gather(x, w, slots_t, pad, h_i)
            torch_path.expand_gather(h_i, w, slots_t, pad, y, offset)

    def _note_split_decode(self) -> None:
        self._fallbacks.note(
            "decode:split-call",
            "decode step through separate shrink/expand calls: npu_batch_gather_matmul fuses both and needs "
            "LoRAOps.apply(x, y, ...); torch path",
        )


def _check_shrink(x: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, out: Tensor) -> None:
    check_shrink(x, weights, meta, out)
    for i, w in enumerate(weights):
        if w.a_rows.dtype != x.dtype:
            raise ValueError(f"shrink: x is {x.dtype} but slice {i}'s a_rows are {w.a_rows.dtype}")
