"""Device-tier storage of LoRA weights for one target slice of one layer.

Adapters are stored at their own rank, never padded to ``max_lora_rank``. All
resident adapters of a slice share two flat row buffers:

    a_rows[slot_start[s] : slot_start[s] + slot_rank[s], :] = A_s        (A_s: [r_s, in])
    b_rows[slot_start[s] : slot_start[s] + slot_rank[s], :] = B_s^T      (B_s: [out, r_s])

so that, for a row t served by slot s = slot(t),

    h[t, :r_s] = x[t] @ A_s^T                     (shrink)
    y[t, :]   += slot_scale[s] * h[t, :r_s] @ B_s^T  (expand)

``slot_rank[s] == 0`` means slot s has nothing for this slice (the adapter does not
target this module): shrink and expand then leave the row untouched. The row
layout is decided by the adapter pool; this object only holds the tensors and the
write/clear primitives. ``host_rank`` mirrors ``slot_rank`` on the host, so planners
(rank buckets, workspace sizes) never read device memory.

Interleaved A (``allocate_projection(..., interleaved=True)``, for backends whose ops ask for it): the K
slices of one fused projection (q/k/v, gate/up) read the same ``x``, so their A rows
can live in one buffer ``a_group[row, i, :] = A row of slice i``. Slice i's ``a_rows``
is then the strided view ``a_group[:, i, :]``, and an adapter whose slices all start at
row ``start`` has every slice's A in one contiguous block,

    a_group[start : start + R].reshape(R * K, in)      (R = max over slices of r_i)

so one matmul does the shrink for all K slices: ``h[t, j, i] = x[t] @ A_i[j]``, of which
columns ``j < r_i`` are used (rows ``r_i .. R`` of slice i are never read as A_i).

When the K slices also have equal widths (q/k/v without GQA, gate/up), their B rows are
interleaved the same way, ``b_group[row, i, :] = B_i^T row``, so an adapter whose slices all
have rank R and one scale has every expand in one batched matmul:
``y[t, o_0 + i*n + c] += scale * sum_j h[t, j, i] * b_group[start + j, i, c]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


WRITE_LOG = 64  # row ranges of the latest writes each slice remembers (``LoRASliceWeights.write_log``)


@dataclass(eq=False)
class LoRASliceWeights:
    """Flat row buffers plus per-slot offsets, ranks and scales (see module docstring)."""

    a_rows: Tensor  # [row_capacity, in_features], compute dtype
    b_rows: Tensor  # [row_capacity, out_features], compute dtype
    slot_start: Tensor  # [max_slots] int32
    slot_rank: Tensor  # [max_slots] int32
    slot_scale: Tensor  # [max_slots] float32
    host_start: list[int] = field(default_factory=list)
    host_rank: list[int] = field(default_factory=list)
    host_scale: list[float] = field(default_factory=list)
    a_group: Tensor | None = None  # [row_capacity, K, in] shared by the K slices of a projection, or None
    b_group: Tensor | None = None  # [row_capacity, K, out] likewise for B, when the K widths are equal
    group_index: int = 0  # this slice's i in a_group[:, i, :]
    version: int = 0  # bumped whenever a slot's start, rank or scale changes
    # ``write_slot``'s writes: [how many in all, then (that count, first row, end row, A's storage, B's
    # storage) of the last WRITE_LOG ones]. One list, so a shallow copy of the slice shares it (as it
    # shares the buffers): ops that cache copies of slot rows can tell which rows changed.
    write_log: list = field(default_factory=lambda: [0])
    # Host-side views that ops derive from the slot table (reference backend), keyed by
    # the ops; an entry records the versions it was built from and is rebuilt when stale.
    view_cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def allocate(
        cls,
        in_features: int,
        out_features: int,
        max_slots: int,
        row_capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "LoRASliceWeights":
        device = torch.device(device)
        return cls(
            a_rows=torch.zeros(row_capacity, in_features, dtype=dtype, device=device),
            b_rows=torch.zeros(row_capacity, out_features, dtype=dtype, device=device),
            slot_start=torch.zeros(max_slots, dtype=torch.int32, device=device),
            slot_rank=torch.zeros(max_slots, dtype=torch.int32, device=device),
            slot_scale=torch.zeros(max_slots, dtype=torch.float32, device=device),
            host_start=[0] * max_slots,
            host_rank=[0] * max_slots,
            host_scale=[0.0] * max_slots,
        )

    @classmethod
    def allocate_projection(
        cls,
        in_features: int,
        outs: "list[int] | tuple[int, ...]",
        max_slots: int,
        row_capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        interleaved: bool = False,
    ) -> "list[LoRASliceWeights]":
        """One slice per entry of ``outs``, all reading the same ``x`` (a fused projection).

        ``interleaved`` (and more than one slice): the A rows share one buffer, and so do the
        B rows when every slice has the same width (see module docstring); otherwise every
        slice gets its own pair."""
        if not interleaved or len(outs) < 2:
            return [cls.allocate(in_features, out, max_slots, row_capacity, dtype, device) for out in outs]
        device = torch.device(device)
        group = torch.zeros(row_capacity, len(outs), in_features, dtype=dtype, device=device)
        b_group = torch.zeros(row_capacity, len(outs), outs[0], dtype=dtype, device=device) if len(set(outs)) == 1 else None
        slices = []
        for i, out_features in enumerate(outs):
            w = cls.allocate(in_features, out_features, max_slots, 0, dtype, device)
            w.a_rows = group[:, i, :]
            w.b_rows = b_group[:, i, :] if b_group is not None else torch.zeros(row_capacity, out_features, dtype=dtype, device=device)
            w.a_group, w.b_group, w.group_index = group, b_group, i
            slices.append(w)
        return slices

    @property
    def in_features(self) -> int:
        return int(self.a_rows.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.b_rows.shape[1])

    @property
    def max_slots(self) -> int:
        return int(self.slot_rank.shape[0])

    @property
    def row_capacity(self) -> int:
        return int(self.a_rows.shape[0])

    @property
    def max_rank(self) -> int:
        return max(self.host_rank, default=0)

    def write_slot(self, slot: int, row_start: int, lora_a: Tensor, lora_b: Tensor, scale: float) -> None:
        """Copy ``A [r, in]`` and ``B [out, r]`` into rows ``row_start .. row_start + r``."""
        rank = int(lora_a.shape[0])
        self._check_slot(slot)
        if lora_a.shape != (rank, self.in_features) or lora_b.shape != (self.out_features, rank):
            raise ValueError(
                f"slot {slot}: A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} do not fit a slice "
                f"with in={self.in_features}, out={self.out_features}"
            )
        if row_start < 0 or row_start + rank > self.row_capacity:
            raise ValueError(f"slot {slot}: rows {row_start}..{row_start + rank} exceed capacity {self.row_capacity}")
        rows = slice(row_start, row_start + rank)
        self.a_rows[rows].copy_(lora_a, non_blocking=True)  # one in-place op per buffer: one version-counter bump each
        self.b_rows[rows].copy_(lora_b.t(), non_blocking=True)
        log = self.write_log
        log[0] += 1
        log.append((log[0], row_start, row_start + rank, self.a_rows.untyped_storage().data_ptr(), self.b_rows.untyped_storage().data_ptr()))
        if len(log) > WRITE_LOG + 1:
            del log[1]
        self._set_slot(slot, row_start, rank, scale)

    def clear_slot(self, slot: int) -> None:
        """Mark ``slot`` empty for this slice (rank 0); its rows may be reused."""
        self._check_slot(slot)
        self._set_slot(slot, 0, 0, 0.0)

    def _check_slot(self, slot: int) -> None:
        """Before anything is written: a slot past the table would fail only after the rows were
        written, and a negative one would write another slot."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is not one of this slice's {self.max_slots} slots (0 .. {self.max_slots - 1})")

    def _set_slot(self, slot: int, start: int, rank: int, scale: float) -> None:
        self.host_start[slot], self.host_rank[slot], self.host_scale[slot] = start, rank, float(scale)
        self.slot_start[slot] = start
        self.slot_rank[slot] = rank
        self.slot_scale[slot] = float(scale)
        self.version += 1


def interleaved_a(weights: "list[LoRASliceWeights] | tuple[LoRASliceWeights, ...]") -> Tensor | None:
    """The shared ``a_group`` when ``weights`` are exactly its K >= 2 slices in order, else None."""
    return _shared_group(weights, "a_group", "a_rows")


def interleaved_b(weights: "list[LoRASliceWeights] | tuple[LoRASliceWeights, ...]") -> Tensor | None:
    """The shared ``b_group`` when ``weights`` are exactly its K >= 2 slices in order, else None."""
    return _shared_group(weights, "b_group", "b_rows")


def _shared_group(weights: "list[LoRASliceWeights] | tuple[LoRASliceWeights, ...]", group_field: str, rows_field: str) -> Tensor | None:
    group = getattr(weights[0], group_field) if weights else None
    if group is None or len(weights) < 2 or len(weights) != group.shape[1]:
        return None
    for i, w in enumerate(weights):
        view = group[:, i, :]
        if getattr(w, group_field) is not group or w.group_index != i:
            return None
        rows = getattr(w, rows_field)
        if rows.data_ptr() != view.data_ptr() or rows.stride() != view.stride() or rows.shape != view.shape:
            return None  # the rows buffer was replaced: it no longer reads from the group
    return group


def shared_block(weights: "list[LoRASliceWeights] | tuple[LoRASliceWeights, ...]", slot: int) -> tuple[int, int] | None:
    """(start, R) when every slice that slot ``slot`` targets starts at the same row (as the
    adapter pool writes them), R being the largest of their ranks; None otherwise."""
    targeted = [(w.host_start[slot], w.host_rank[slot]) for w in weights if w.host_rank[slot] > 0]
    if not targeted or any(start != targeted[0][0] for start, _ in targeted):
        return None
    return targeted[0][0], max(r for _, r in targeted)
