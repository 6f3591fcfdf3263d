"""GateAdapter: what the adapter gate (``runtime.capabilities.check_adapter``) reads of an
adapter, and nothing else, for verifiers that ask the gate about ranks and target modules
without writing adapter files."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class ModuleRank:
    """The attribute of a LoRAModule the gate reads."""

    rank: int


@dataclass(frozen=True)
class GateAdapter:
    """``name`` and ``modules``: (layer, module name) -> a module of the rank given in ``ranks``."""

    name: str
    ranks: Mapping[tuple[int, str], int]

    @property
    def modules(self) -> dict[tuple[int, str], ModuleRank]:
        return {key: ModuleRank(rank) for key, rank in self.ranks.items()}
