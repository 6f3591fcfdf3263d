"""Decode attention on the CPU: one padded group vs groups sized to the cache.

    .venv/bin/python benchmarks/decode_attention.py [--batch 32] [--heads 8] [--head-dim 64] [--json out.json]

For several ranges of context lengths, builds a paged KV cache with scattered blocks and a
batch of decode rows (one new token per sequence, contexts drawn uniformly from the range),
then times ``ReferenceAttention.paged_attention`` with ``group_bytes=None`` (every decode in
one gather of whole blocks, padded to the longest context, + one SDPA) and with
``--group-bytes`` (default: the CPU backend's ``CPU_ATTENTION_GROUP_BYTES``). The two are
called in turn after one warm-up pass over every range, so machine drift hits both alike; both
outputs are checked against a float64 dense reference. Reports the median time per call, the
ratio, and the number of decode groups the grouped variant ran (from the step plan
``paged_attention`` built).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.reference import CPU_ATTENTION_GROUP_BYTES, ReferenceAttention  # noqa: E402
from runtime.kv.attention_meta import AttentionMeta  # noqa: E402

RANGES = ((40, 60), (20, 100), (200, 300), (10, 612), (500, 612))


def decode_step(batch: int, heads: int, head_dim: int, lo: int, hi: int, block_size: int, seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ctx = [rng.randint(lo, hi) for _ in range(batch)]
    blocks_needed = [-(-c // block_size) for c in ctx]
    n_blocks = sum(blocks_needed) + 8
    order = torch.randperm(n_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(order[used : used + n])
        used += n
    cache = torch.randn(2, n_blocks * block_size, heads, head_dim, generator=gen)
    meta = AttentionMeta.build([1] * batch, ctx, tables, block_size)
    q, k, v = (torch.randn(batch, heads, head_dim, generator=gen) for _ in range(3))
    return q, k, v, cache, meta


def dense_float64(q, k, v, cache, meta: AttentionMeta, scale: float) -> torch.Tensor:
    """float64 decode attention: each sequence's keys and values read from the cache in block-table
    order, its new token's at its last position; one softmax per head (no GQA)."""
    bs = meta.block_size
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, ctx in enumerate(meta.host_context_lens):
        table = torch.tensor(meta.host_block_tables[b])
        idx = (table[:, None] * bs + torch.arange(bs)).reshape(-1)[: ctx - 1]
        keys = torch.cat([cache[0, idx].double(), k[b : b + 1].double()])  # [ctx, H, D]
        vals = torch.cat([cache[1, idx].double(), v[b : b + 1].double()])
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[b].double(), keys) * scale, dim=1)
        out[b] = torch.einsum("hl,lhd->hd", weights, vals)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32, help="decode rows (sequences) per step")
    p.add_argument("--heads", type=int, default=8, help="query and kv heads (no GQA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--calls", type=int, default=20, help="timed calls per variant and range")
    p.add_argument("--group-bytes", type=int, default=CPU_ATTENTION_GROUP_BYTES, help="K bytes per decode group for the grouped variant")
    p.add_argument("--json", type=str, default=None, help="write the results here")
    a = p.parse_args()
    if min(a.batch, a.heads, a.head_dim, a.block_size, a.calls, a.group_bytes) < 1:
        p.error("--batch, --heads, --head-dim, --block-size, --calls and --group-bytes must be positive")
    variants = {"one group": ReferenceAttention(None), f"groups of {a.group_bytes} B": ReferenceAttention(a.group_bytes)}
    grouped = variants[f"groups of {a.group_bytes} B"]
    steps = {(lo, hi): decode_step(a.batch, a.heads, a.head_dim, lo, hi, a.block_size, seed=lo * 1000 + hi) for lo, hi in RANGES}
    scale = a.head_dim**-0.5
    for _ in range(3):  # warm-up over every range first, so the first range timed is not the first run
        for q, k, v, cache, meta in steps.values():
            for att in variants.values():
                att.paged_attention(q, k, v, cache, meta, scale)
    rows = []
    print(f"{'contexts':>10} " + " ".join(f"{name:>16}" for name in variants) + "   ratio   groups")
    for (lo, hi), (q, k, v, cache, meta) in steps.items():
        expected = dense_float64(q, k, v, cache, meta, scale)
        errors = {}
        for name, att in variants.items():
            got = att.paged_attention(q, k, v, cache, meta, scale).double()
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}, contexts {lo}-{hi}: {m}")
            errors[name] = float((got - expected).abs().max())
        assert grouped._plan is not None and grouped._plan[0] is meta
        n_groups = len(grouped._plan[1])  # the decode groups that call ran
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(a.calls):
            for name, att in variants.items():
                start = time.perf_counter()
                att.paged_attention(q, k, v, cache, meta, scale)
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        one, grouped_ms = ms.values()
        rows.append({"contexts": [lo, hi], "ms": ms, "speedup": round(one / grouped_ms, 2), "groups": n_groups, "max_abs_err_vs_float64": errors})
        print(f"{lo:>4}-{hi:<5} " + " ".join(f"{m:13.2f} ms" for m in ms.values()) + f"   {one / grouped_ms:5.2f}x   {n_groups:6d}")
    if a.json:
        Path(a.json).write_text(json.dumps({"config": vars(a), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
