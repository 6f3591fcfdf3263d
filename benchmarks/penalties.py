"""The sampler's penalties: sparse (``penalize_rows_``, what the engine runs) vs dense masks.

    python benchmarks/penalties.py [--batches 64x32000,8x32000,64x152064] [--prompt-len 200] [--output-len 100] [--rounds 5]

Each batch is rows x vocab float32 logits whose rows all have presence, frequency and
repetition penalties, a prompt of ``--prompt-len`` and ``--output-len`` generated tokens
(random ids). The dense baseline is the method the sampler used before: a count of every
(row, token) by ``bincount`` over rows x vocab, a seen mask of the same size, and ``where`` over
the whole batch. Both are checked equal bit for bit, then timed in alternating rounds on one
thread (the engine's sampler runs on the step thread); the medians and their ratio are printed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.request import SamplingParams  # noqa: E402
from runtime.sampler import penalize_rows_  # noqa: E402


def dense_penalize(z: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[torch.Tensor], outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """The baseline: the same formula over dense rows x vocab counts and masks."""
    n, vocab = z.shape
    z = z.float()
    finfo = torch.finfo(torch.float32)
    flat = torch.tensor([i * vocab + t for i, out in enumerate(outputs) for t in out], dtype=torch.long)
    counts = torch.bincount(flat, minlength=n * vocab).view(n, vocab).float()
    seen = counts > 0
    seen.view(-1)[torch.cat([p + i * vocab for i, p in enumerate(prompts)])] = True
    r = torch.tensor([p.repetition_penalty for p in params])[:, None].clamp(finfo.tiny, finfo.max)
    z = torch.where(seen, torch.where(z > 0, (z / r).clamp(max=finfo.max), z * r), z)
    freq = torch.tensor([p.frequency_penalty for p in params])[:, None]
    pres = torch.tensor([p.presence_penalty for p in params])[:, None]
    return z - freq * counts - pres * (counts > 0).float()


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="64x32000,8x32000,64x152064", help="rows x vocab, comma separated")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    print(f"{'batch':>12} {'sparse ms':>10} {'dense ms':>10} {'dense / sparse':>15}")
    for spec in args.batches.split(","):
        rows, vocab = (int(x) for x in spec.lower().split("x"))
        z = torch.randn(rows, vocab, generator=gen) * 4
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen) for _ in range(rows)]
        outputs = [torch.randint(0, vocab, (args.output_len,), generator=gen).tolist() for _ in range(rows)]
        every = [params] * rows

        def sparse() -> torch.Tensor:
            out = z.clone()
            penalize_rows_(out, list(range(rows)), every, prompts, outputs)
            return out

        if not torch.equal(sparse(), dense_penalize(z, every, prompts, outputs)):
            print(f"{spec}: sparse and dense penalties differ", file=sys.stderr)
            return 1
        sparse_ms, dense_ms = [], []
        for _ in range(args.rounds):  # alternating, so drifts in machine load hit both
            sparse_ms.append(timed(sparse))
            dense_ms.append(timed(lambda: dense_penalize(z, every, prompts, outputs)))
        s, d = statistics.median(sparse_ms), statistics.median(dense_ms)
        print(f"{spec:>12} {s:>10.1f} {d:>10.1f} {d / s:>14.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
