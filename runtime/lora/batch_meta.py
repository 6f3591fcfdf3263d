"""Per-step LoRA launch metadata, built once per step and shared by every layer.

A step holds ``T`` token rows. Row ``t`` belongs to adapter slot ``token_slots[t]``
(``-1`` means "no adapter": the row gets the base output only). Segment kernels
(SGMV, prefill) walk rows grouped by slot; per-token kernels (BGMV, decode) index
``token_slots`` directly.

    sorted_tokens = stable argsort of token_slots, rows with slot -1 dropped
    seg_starts[i] .. seg_starts[i+1]  = positions in sorted_tokens of segment i
    seg_slots[i]                      = the slot of segment i
    seg_tiles[2j], seg_tiles[2j+1]    = (segment, first position) of tile j: every segment cut
                                        into runs of at most SEGMENT_TILE_ROWS positions, so a
                                        segment kernel launches one program per tile, not
                                        (segments x the longest segment's blocks)

When the rows with an adapter already sit in slot order, one contiguous run of
rows (the model runner orders every step's sequences by adapter, so the engine's
steps always do), ``first_row`` is where that run starts and segment i is simply
rows ``first_row + seg_starts[i] .. first_row + seg_starts[i+1]`` of the step:
backends may then work on row ranges in place, with no gather or scatter.

Everything is built on the host from Python lists and copied to the device in
one go, so no layer ever needs a host<->device sync to find its segments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

NO_ADAPTER = -1
SECTION_ALIGN_INT32 = 4  # int32s per 16 bytes: every packed section starts aligned (see build)
SEGMENT_TILE_ROWS = 64  # rows per seg_tiles entry (the CUDA segment kernels' largest row block)


def adapter_order(slots: Sequence[int]) -> list[int]:
    """Indices of ``slots`` grouped by adapter slot, ascending, rows with no adapter (-1)
    last; stable. Running a step's rows in this order makes ``first_row`` set."""
    return sorted(range(len(slots)), key=lambda i: (slots[i] == NO_ADAPTER, slots[i]))


@dataclass(frozen=True)
class LoRABatchMeta:
    """Row -> adapter-slot mapping for one step (see module docstring for the math)."""

    token_slots: Tensor  # [T] int32, slot of each row, -1 = no adapter
    sorted_tokens: Tensor  # [N] int32, rows with an adapter, grouped by slot (stable)
    seg_slots: Tensor  # [S] int32, slot of each segment
    seg_starts: Tensor  # [S+1] int32, offsets into sorted_tokens
    decode_only: bool  # every row is one decode token -> the BGMV path may be used
    # Host copies, so host-side planners (e.g. the Ascend grouped-matmul split) never
    # read device memory back.
    host_seg_slots: tuple[int, ...]
    host_seg_starts: tuple[int, ...]
    max_seg_len: int  # longest segment, sizes the segment kernels' row block
    first_row: int | None = None  # rows with an adapter are first_row .. first_row+N-1, in slot order; else None
    seg_tiles: Tensor | None = None  # [2 * n_tiles] int32, (segment, first position) pairs; see the module docstring

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.shape[0])

    @property
    def num_segments(self) -> int:
        return len(self.host_seg_slots)

    @property
    def num_tiles(self) -> int:
        """Entries of ``seg_tiles`` (0 when the meta was built without them)."""
        return 0 if self.seg_tiles is None else int(self.seg_tiles.shape[0]) // 2

    @property
    def has_lora(self) -> bool:
        return self.num_segments > 0

    @classmethod
    def build(
        cls,
        token_slots: Sequence[int],
        device: torch.device | str = "cpu",
        decode_only: bool = False,
    ) -> "LoRABatchMeta":
        """Group rows by slot. ``token_slots`` is a host list; no device reads happen."""
        slots = [int(s) for s in token_slots]
        for s in slots:
            if s < NO_ADAPTER:
                raise ValueError(f"token slot {s} is invalid: slots are >= 0, or -1 for no adapter")
        order = sorted((i for i, s in enumerate(slots) if s != NO_ADAPTER), key=lambda i: slots[i])
        seg_slots: list[int] = []
        seg_starts: list[int] = [0]
        for pos, row in enumerate(order):
            if not seg_slots or slots[row] != seg_slots[-1]:
                if seg_slots:
                    seg_starts.append(pos)
                seg_slots.append(slots[row])
        if seg_slots:
            seg_starts.append(len(order))
        lengths = [b - a for a, b in zip(seg_starts[:-1], seg_starts[1:])]
        one_run = bool(order) and all(b == a + 1 for a, b in zip(order, order[1:]))
        first_row = order[0] if one_run else None
        device = torch.device(device)
        # One packed host tensor, one copy to the device. Each section starts on a 16-byte
        # boundary: Triton compiles a kernel variant per alignment pattern of its pointer
        # arguments, so unaligned views would compile up to 8 variants of each segment kernel
        # as batch sizes vary (a stall of about a second each on first use).
        tiles = [v for g in range(len(seg_slots)) for m in range(seg_starts[g], seg_starts[g + 1], SEGMENT_TILE_ROWS) for v in (g, m)]
        sections = (slots, order, seg_slots, seg_starts, tiles)
        flat: list[int] = []
        starts = []
        for values in sections:
            starts.append(len(flat))
            flat += values + [0] * (-len(values) % SECTION_ALIGN_INT32)
        packed = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
        views = [packed[start : start + len(values)] for start, values in zip(starts, sections)]
        return cls(
            token_slots=views[0],
            sorted_tokens=views[1],
            seg_slots=views[2],
            seg_starts=views[3],
            seg_tiles=views[4],
            decode_only=decode_only,
            host_seg_slots=tuple(seg_slots),
            host_seg_starts=tuple(seg_starts),
            max_seg_len=max(lengths, default=0),
            first_row=first_row,
        )
