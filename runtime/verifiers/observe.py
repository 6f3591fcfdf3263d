"""Which torch operations a backend call ran: lets a verifier confirm the code path it vouches for.

A numerical check alone cannot tell which of a backend's equivalent schedules produced the
result; a case built to reach one schedule would keep passing if a change made the backend
quietly take another. ``CallCounter`` records every torch function and tensor method the
calls inside its ``with`` block run (``torch.overrides.TorchFunctionMode``), so a verifier
can require, e.g., that the batched ``baddbmm_`` expand ran, or how many SDPA calls
(decode groups) a paged-attention step made. Read-only: it calls each function unchanged.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from torch.overrides import TorchFunctionMode


class CallCounter(TorchFunctionMode):
    """``with CallCounter() as calls: ...`` then ``calls["baddbmm_"]``: how often each torch
    function or tensor method (by ``__name__``) ran inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.counts[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))

    def __getitem__(self, name: str) -> int:
        return self.counts[name]
