"""The op grid shared by the emulated and the hardware Ascend tests: random slice
weights at mixed ranks, adapter popularity patterns with no-adapter rows, and an
independent float64 expectation of ``y += LoRA(x)``."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from runtime.lora.slice_weights import LoRASliceWeights

POPULARITY = ("identical", "distinct", "uniform", "zipf")


def make_weights(
    dims: Sequence[tuple[int, int]],
    ranks: Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device | str,
    gen: torch.Generator,
) -> list[LoRASliceWeights]:
    """One ``LoRASliceWeights`` per slice; ``ranks[i][s]`` is slot s's rank in slice i (0 = absent).

    Like the pool, each slot owns one row range as long as its largest rank over slices.
    """
    n_slots = len(ranks[0])
    widths = [max(r[s] for r in ranks) for s in range(n_slots)]
    starts = [sum(widths[:s]) for s in range(n_slots)]
    rows = max(sum(widths), 1)
    out = []
    for (fan_in, fan_out), slice_ranks in zip(dims, ranks):
        w = LoRASliceWeights.allocate(fan_in, fan_out, n_slots, rows, dtype, device)
        for s, r in enumerate(slice_ranks):
            if r:
                a = torch.randn(r, fan_in, generator=gen) * 0.2
                b = torch.randn(fan_out, r, generator=gen) * 0.2
                scale = 0.5 + 1.5 * torch.rand((), generator=gen).item()
                w.write_slot(s, starts[s], a.to(dtype), b.to(dtype), scale)
        out.append(w)
    return out


def token_slots(pattern: str, num_tokens: int, num_slots: int, gen: torch.Generator) -> list[int]:
    """Row -> slot for one popularity pattern; about one row in five has no adapter (-1)."""
    if pattern == "identical":
        slots = [0] * num_tokens
    elif pattern == "distinct":
        slots = [t % num_slots for t in range(num_tokens)]
    elif pattern == "uniform":
        slots = torch.randint(0, num_slots, (num_tokens,), generator=gen).tolist()
    elif pattern == "zipf":
        p = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64) ** 1.2
        slots = torch.multinomial(p, num_tokens, replacement=True, generator=gen).tolist()
    else:
        raise ValueError(f"unknown popularity pattern {pattern!r}; choose one of {POPULARITY}")
    none_rows = torch.rand(num_tokens, generator=gen) < 0.2
    return [-1 if none_rows[t] else s for t, s in enumerate(slots)]


def expected_float64(x: Tensor, y: Tensor, weights: Sequence[LoRASliceWeights], slots: Sequence[int], offsets: Sequence[int]) -> Tensor:
    """``y + LoRA(x)`` in float64, row by row, from the weights' host mirrors."""
    out = y.double().cpu().clone()
    xd = x.double().cpu()
    for t, s in enumerate(slots):
        if s < 0:
            continue
        for w, off in zip(weights, offsets):
            r, start = w.host_rank[s], w.host_start[s]
            if r == 0:
                continue
            a = w.a_rows[start : start + r].double().cpu()
            b_t = w.b_rows[start : start + r].double().cpu()
            out[t, off : off + w.out_features] += w.host_scale[s] * (xd[t] @ a.t()) @ b_t
    return out


TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}
