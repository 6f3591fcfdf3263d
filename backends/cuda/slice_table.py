"""Per-slice pointer tables: how one kernel launch serves several LoRA slices.

A multi-slice launch (q/k/v, or gate/up, in ONE kernel) needs, for slice ``i``, the
addresses of that slice's flat buffers and slot tables plus its output columns.
They are packed into one int64 device tensor, one row per slice:

    table[i] = [a_rows ptr, b_rows ptr, slot_start ptr, slot_rank ptr, slot_scale ptr,
                out_features, column offset in y, 0]

Kernels read row ``program_id(slice axis)`` and cast the addresses back to pointers.
The buffers it points at are persistent (adapter loads write into them in place), so
a table is built once per (slice group, offsets) and reused by every later step: no
host->device copy happens in a steady-state forward, which keeps the forward
CUDA-graph safe once each layer has run once (the usual warm-up before capture).
A table is rebuilt if any buffer was reallocated (its ``data_ptr`` changed).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch
import triton.language as tl
from torch import Tensor

from backends.cuda.lora_checks import check_weights
from runtime.lora.op_arguments import check_offsets
from runtime.lora.slice_weights import LoRASliceWeights

# Layout of one table row; constexpr so the kernels can index with them.
TABLE_WIDTH = tl.constexpr(8)
COL_A, COL_B, COL_START, COL_RANK, COL_SCALE, COL_OUT, COL_OFFSET = (tl.constexpr(i) for i in range(7))


def _disjoint(ranges: Sequence[tuple[int, int]]) -> bool:
    ordered = sorted(ranges)
    return all(end <= next_start for (_, end), (next_start, _) in zip(ordered, ordered[1:]))


def _addresses(weights: Sequence[LoRASliceWeights]) -> tuple[int, ...]:
    return tuple(
        t.data_ptr() for w in weights for t in (w.a_rows, w.b_rows, w.slot_start, w.slot_rank, w.slot_scale)
    )


@dataclass(frozen=True)
class SliceTable:
    """The device table of one slice group, plus the host facts its launch needs."""

    table: Tensor  # [n_slices, TABLE_WIDTH] int64 on the weights' device
    addresses: tuple[int, ...]  # data_ptrs it was built from (staleness check)
    offsets: tuple[int, ...]  # column offset of each slice in y (host copy)
    n_slices: int
    max_out: int  # widest slice, sizes the expand kernels' column-block axis
    y_width: int  # y needs at least this many columns (max of offset + out_features)
    dtype: torch.dtype  # of every slice's a_rows / b_rows
    device: torch.device
    in_features: int
    max_slots: int  # the fewest slots of any slice
    disjoint: bool  # no two slices' y columns [offset, offset + out) overlap (expand requires it)

    @classmethod
    def build(cls, weights: Sequence[LoRASliceWeights], slice_offsets: Sequence[int], op: str = "slice table") -> "SliceTable":
        """Validate the slice group once (dtypes, layouts, devices) and pack its table."""
        check_weights(op, weights)
        if len(weights) != len(slice_offsets):
            raise ValueError(f"{op}: {len(weights)} slices but {len(slice_offsets)} slice_offsets")
        check_offsets(op, slice_offsets)
        rows = [
            [w.a_rows.data_ptr(), w.b_rows.data_ptr(), w.slot_start.data_ptr(), w.slot_rank.data_ptr(),
             w.slot_scale.data_ptr(), w.out_features, int(off), 0]
            for w, off in zip(weights, slice_offsets)
        ]
        device = weights[0].a_rows.device
        return cls(
            table=torch.tensor(rows, dtype=torch.int64).to(device),
            addresses=_addresses(weights),
            offsets=tuple(int(o) for o in slice_offsets),
            n_slices=len(weights),
            max_out=max(w.out_features for w in weights),
            y_width=max(int(o) + w.out_features for w, o in zip(weights, slice_offsets)),
            dtype=weights[0].a_rows.dtype,
            device=device,
            in_features=weights[0].in_features,
            disjoint=_disjoint([(int(o), int(o) + w.out_features) for w, o in zip(weights, slice_offsets)]),
            max_slots=min(w.max_slots for w in weights),
        )

    @classmethod
    def for_call(cls, op: str, weights: Sequence[LoRASliceWeights], slice_offsets: Sequence[int], table: "SliceTable | None") -> "SliceTable":
        """The table a launcher uses: the caller's (checked against these weights), or a new one."""
        if table is None:
            table = cls.build(weights, slice_offsets, op=op)
        table.check(op, weights, slice_offsets)
        return table

    def is_current(self, weights: Sequence[LoRASliceWeights]) -> bool:
        return self.addresses == _addresses(weights)

    def check(self, op: str, weights: Sequence[LoRASliceWeights], slice_offsets: Sequence[int]) -> None:
        """Reject a table that does not describe exactly these weights and offsets."""
        if self.n_slices != len(weights) or not self.is_current(weights):
            raise ValueError(f"{op}: the slice table was built for other weights (or they were reallocated); rebuild it")
        if self.offsets != tuple(int(o) for o in slice_offsets):
            raise ValueError(f"{op}: the slice table has offsets {self.offsets}, the call passes {tuple(slice_offsets)}")
        if self.table.device != weights[0].a_rows.device:
            raise ValueError(f"{op}: the slice table is on {self.table.device}, the weights on {weights[0].a_rows.device}")


class SliceTableCache:
    """Tables keyed by the identity of a slice group and its offsets, built on first use.

    Entries hold weak references to the weights, so a group that is freed (and whose
    ``id`` may be reused) is never matched; the cache is bounded (least recently used
    entries go first) so short-lived groups, e.g. in tests, do not accumulate.
    """

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"SliceTableCache: capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._entries: OrderedDict[tuple, tuple[tuple[weakref.ref, ...], SliceTable]] = OrderedDict()

    def get(self, weights: Sequence[LoRASliceWeights], slice_offsets: Sequence[int]) -> SliceTable:
        key = (tuple(id(w) for w in weights), tuple(int(o) for o in slice_offsets))
        hit = self._entries.get(key)
        if hit is not None:
            refs, table = hit
            if all(r() is w for r, w in zip(refs, weights)) and table.is_current(weights):
                self._entries.move_to_end(key)
                return table
        table = SliceTable.build(weights, slice_offsets)
        self._entries[key] = (tuple(weakref.ref(w) for w in weights), table)
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
        return table

    def __len__(self) -> int:
        return len(self._entries)
