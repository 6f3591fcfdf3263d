"""Keep the engine's step thread the only OpenMP thread team in the process.

With OpenMP, every thread that runs a parallel torch op gets its own team of worker
threads. A second team (e.g. from a helper thread reading adapter files) makes OpenMP
throttle its spin-waits, and the step thread's many small ops then pay a futex wake-up
each: measured ~2x slower multi-LoRA steps on 2 cores (docs/benchmarks.md). Helper
threads call ``single_threaded_torch`` as their initializer so they never start a team.
"""
from __future__ import annotations

import torch


def single_threaded_torch() -> None:
    """Thread initializer: torch ops in the calling thread run on one core."""
    torch.set_num_threads(1)
