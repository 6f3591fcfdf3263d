"""Fresh randomness for verifiers: a new seed per run (reported, so a failure can be replayed)."""
from __future__ import annotations

import secrets

import torch

from runtime.capabilities import Capability, CapabilityMatrix, Limits


def fresh_seed() -> int:
    return secrets.randbits(31)


def pick_ranks(limits: Limits, count: int, seed: int, even: bool = False) -> list[int]:
    """``count`` ranks the limits admit (``even``: even ones only): the smallest, the largest, then random others."""
    admissible = [r for r in limits.admissible_ranks() if not even or r % 2 == 0]
    if not admissible:
        return []
    g = torch.Generator().manual_seed(seed)
    picks = [admissible[0], admissible[-1]]
    while len(picks) < count:
        picks.append(admissible[int(torch.randint(0, len(admissible), (1,), generator=g))])
    return picks[:count]


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def declared_dtypes(entry: Capability, matrix: CapabilityMatrix, limits: Limits | None = None) -> tuple[str, ...]:
    """The dtypes a check must cover: the limits' own, else the backend's ``dtypes`` capability."""
    own = (limits or entry.limits).dtypes
    return own if own is not None else matrix.entry(entry.backend, "dtypes").limits.dtypes or ("float32",)
