"""Merged vs dynamic serving on CPU: the same workload three ways, and where the crossover lies.

    .venv/bin/python benchmarks/merge_vs_dynamic.py [--hidden 512] [--layers 4] [--requests 32] [--out results.json]

Random llama (hidden 512, 4 layers, 8 heads unless ``--hidden``/``--layers`` say
otherwise: ``LlamaShape.sized``) and rank-16 q/k/v/o adapters, built in a temp dir
(nothing downloaded). Every run uses the real engine (``runtime.engine.LLMEngine``:
continuous batching, paged KV, the cpu backend); all requests are submitted up front,
throughput = generated tokens / wall time of the run to completion.

1. merged single-adapter: a checkpoint from ``lorafleet merge`` (run_merge), no LoRA at all;
2. dynamic single-adapter: base + one adapter, every request names it;
3. dynamic, 8 mixed adapters: base + 8 adapters, requests round-robin over them.

Crossover: serving N adapters with merged models means N models, each receiving 1/N of
the traffic (smaller batches, run one after another on this one machine), against one
dynamic engine batching all N. For N in 1, 2, 4, 8 we time both and report the smallest
N where merged stops being faster. The requests are split into N shares as even as
possible (sizes differ by at most one), so the merged fleet serves every request too.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench.suite import offline_throughput  # noqa: E402
from runtime.bench.synthetic import LlamaShape, build_random_adapter, build_random_llama  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.merge.merge_job import MergeOptions, run_merge  # noqa: E402
from runtime.request import SamplingParams  # noqa: E402

RANK = 16


def timed_run(model: Path, adapters: dict[str, Path], picks: list, prompts: list, params: SamplingParams) -> dict:
    config = EngineConfig(model=str(model), device="cpu", max_num_seqs=32, max_num_batched_tokens=512, block_size=16,
                          num_kv_blocks=256, max_loras=8, max_lora_rank=RANK, max_cpu_loras=8)  # fmt: skip
    result = offline_throughput(config, adapters, list(zip(prompts, picks)), params)
    print(f"  {model.name} adapters={len(adapters)} requests={len(prompts)}: {result['tokens']} tokens in {result['wall_s']:.2f}s", file=sys.stderr, flush=True)
    return {k: result[k] for k in ("tokens", "wall_s", "tokens_per_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512, help="model hidden size (max(1, hidden // 64) heads; 512 = the documented run)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (4 = the documented run)")
    parser.add_argument("--requests", type=int, default=32, help="requests per workload (at least 8: one per merged model at N = 8)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    try:
        shape = LlamaShape.sized(args.hidden, args.layers)
    except ValueError as err:
        parser.error(str(err))
    if args.requests < 8:
        parser.error(f"--requests must be >= 8 (the 8-model merged fleet needs a request per model), got {args.requests}")
    if args.prompt_len < 1 or args.max_tokens < 1:
        parser.error("--prompt-len and --max-tokens must be >= 1")
    rng = random.Random(0)
    results: dict = {"config": vars(args), "model": dict(shape.__dict__), "rank": RANK, "torch_threads": torch.get_num_threads(), "runner": "LLMEngine (cpu backend)"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = build_random_llama(root / "base", shape)
        adapters = {f"a{i}": build_random_adapter(root / f"a{i}", shape, RANK, i) for i in range(8)}
        merged = {}
        for n in ("a0",):
            merged[n] = root / f"merged_{n}"
            run_merge(MergeOptions(model=str(base), adapter=str(adapters[n]), out=str(merged[n]), verify=False, progress=False))
        prompts = [[rng.randrange(0, 256) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        r = args.requests
        results["merged_single"] = timed_run(merged["a0"], {}, [None] * r, prompts, params)
        results["dynamic_single"] = timed_run(base, {"a0": adapters["a0"]}, ["a0"] * r, prompts, params)
        results["dynamic_mixed_8"] = timed_run(base, adapters, [f"a{i % 8}" for i in range(r)], prompts, params)
        crossover = {}
        for n in (2, 4, 8):
            # N merged models on one machine: each serves its 1/N share, one after another (same weights shape, so
            # one merged model timed on a 1/N batch, N times, stands for them). Shares differ by at most one request.
            bounds = [i * r // n for i in range(n + 1)]
            parts = [timed_run(merged["a0"], {}, [None] * (hi - lo), prompts[lo:hi], params) for lo, hi in zip(bounds, bounds[1:])]
            tokens = sum(p["tokens"] for p in parts)
            # Each share's wall time as tokens / tokens_per_s: wall_s is rounded to 1 ms, which a share of a small
            # model can round to 0, while tokens_per_s keeps the wall time to ~4 significant digits.
            wall = sum(p["tokens"] / p["tokens_per_s"] for p in parts)
            dyn = results["dynamic_mixed_8"] if n == 8 else timed_run(base, {f"a{i}": adapters[f"a{i}"] for i in range(n)},
                                                                       [f"a{i % n}" for i in range(r)], prompts, params)  # fmt: skip
            crossover[n] = {"merged_fleet_tokens_per_s": round(tokens / wall, 1), "dynamic_mixed_tokens_per_s": dyn["tokens_per_s"],
                            "merged_fleet_tokens": tokens, "merged_fleet_wall_s": round(wall, 3)}  # fmt: skip
        crossover[1] = {"merged_fleet_tokens_per_s": results["merged_single"]["tokens_per_s"],
                        "dynamic_mixed_tokens_per_s": results["dynamic_single"]["tokens_per_s"],
                        "merged_fleet_tokens": results["merged_single"]["tokens"], "merged_fleet_wall_s": results["merged_single"]["wall_s"]}  # fmt: skip
        results["by_adapter_count"] = dict(sorted(crossover.items()))
        slower = [n for n, c in sorted(crossover.items()) if c["merged_fleet_tokens_per_s"] <= c["dynamic_mixed_tokens_per_s"]]
        results["crossover_adapters"] = slower[0] if slower else None
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
