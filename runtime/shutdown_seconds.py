"""check_shutdown_seconds: the lengths a shutdown is given (its drain, a stuck step's grace) must be
numbers of seconds >= 0; ``math.inf`` (no end) is one.

Both become deadlines that waits are polled against. A negative one had passed before the
shutdown began: a drain of -5 s is no drain at all, which nothing said. NaN compares false with
every time, so a wait polled until it passes never ends: ``AsyncLLMEngine.shutdown`` with a NaN
grace waited for ever for a stuck step that it was meant to give up on.
"""
from __future__ import annotations

import math
from numbers import Real


def check_shutdown_seconds(**durations: object) -> None:
    """ValueError naming the first of ``durations`` (name=value) that is not a real number >= 0."""
    for name, value in durations.items():
        if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(value) or value < 0:
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
