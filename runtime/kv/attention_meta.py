"""Per-step paged-attention metadata, built once per step and shared by every layer.

The step's ``T`` token rows are the concatenation of ``B`` sequences' new tokens:
rows ``query_starts[b] .. query_starts[b+1]`` belong to sequence ``b``. Sequence b's
KV history (including this step's new tokens) has ``context_lens[b]`` entries,
stored in fixed-size blocks: entry ``j`` lives at

    block_tables[b, j // block_size] * block_size + j % block_size

of the flattened cache. ``slot_mapping[t]`` is where row t's new K/V is written.
The new tokens of sequence b occupy the last ``q_len_b`` positions of its context,
so row i of sequence b attends causally to entries ``0 .. context_lens[b] - q_len_b + i``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttentionMeta:
    slot_mapping: Tensor  # [T] int64, flat cache index of each new row's K/V
    block_tables: Tensor  # [B, max_blocks] int32, padded with 0
    query_starts: Tensor  # [B+1] int32
    context_lens: Tensor  # [B] int32
    block_size: int
    host_query_starts: tuple[int, ...]
    host_context_lens: tuple[int, ...]
    host_block_tables: tuple[tuple[int, ...], ...]

    @property
    def num_seqs(self) -> int:
        return len(self.host_context_lens)

    @property
    def decode_only(self) -> bool:
        q = self.host_query_starts
        return all(q[i + 1] - q[i] == 1 for i in range(len(q) - 1))

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMeta":
        """Build from host lists. ``context_lens[b]`` counts this step's tokens too."""
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have one entry per sequence")
        starts = [0]
        slots: list[int] = []
        for q_len, ctx, table in zip(query_lens, context_lens, block_tables):
            if q_len < 1 or ctx < q_len:
                raise ValueError(f"bad sequence: {q_len} new tokens with context length {ctx}")
            if len(table) * block_size < ctx:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {ctx} tokens")
            starts.append(starts[-1] + q_len)
            for pos in range(ctx - q_len, ctx):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        device = torch.device(device)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
            block_tables=torch.tensor(padded, dtype=torch.int32).reshape(len(padded), width).to(device, non_blocking=True),
            query_starts=torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True),
            context_lens=torch.tensor(list(context_lens), dtype=torch.int32).to(device, non_blocking=True),
            block_size=block_size,
            host_query_starts=tuple(starts),
            host_context_lens=tuple(int(c) for c in context_lens),
            host_block_tables=tuple(tuple(int(b) for b in t) for t in block_tables),
        )
