"""check_shutdown_seconds: the lengths a shutdown is given (its drain, a stuck step's grace) must be
numbers of seconds >= 0; ``math.inf`` (no end) is one. Also ``STEP_GRACE_S``, the stuck step's
default grace.

Both become deadlines that waits are polled against. A negative one had passed before the
shutdown began: a drain of -5 s is no drain at all, which nothing said. NaN compares false with
every time, so a wait polled until it passes never ends: ``AsyncLLMEngine.shutdown`` with a NaN
grace waited for ever for a stuck step that it was meant to give up on.
"""
from __future__ import annotations

import math
from numbers import Real

# AsyncLLMEngine.shutdown: how long a step still running when the drain ends is waited for before it
# counts as stuck. Here, not in async_engine (which re-exports it), so that the Ray application's
# timeout check (``runtime/distributed/shutdown_timeouts.py``) needs no torch: the registry actor,
# which does not load it, checks a drain it is asked for too.
STEP_GRACE_S = 3.0


def check_shutdown_seconds(**durations: object) -> None:
    """ValueError naming the first of ``durations`` (name=value) that is not a real number >= 0."""
    for name, value in durations.items():
        if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(value) or value < 0:
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
