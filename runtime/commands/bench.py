"""`lorafleet bench`: replay a synthetic multi-adapter workload and print a summary table.

In-process by default: a random Llama and random PEFT adapters are written to
--workdir (reused across runs). With --url it streams the workload from a running
`lorafleet serve` instead; the server must have adapters named like the workload's
(lora-0000, lora-0001, ...), or use --base-fraction 1 so every request names the base.
Over HTTP the adapter pool counters (swaps, cache hits) are not measured: read them from
the server's /metrics.
benchmarks/serve.py runs the full suite with baselines and plots.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from runtime.bench.workload import add_spec_arguments

    add_spec_arguments(p)
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--hidden", type=int, default=512, help="synthetic model hidden size")
    p.add_argument("--layers", type=int, default=4, help="synthetic model layers")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--max-cpu-loras", type=int, default=None, help="host-tier adapters (default: max(32, --max-loras)); at least --max-loras")
    p.add_argument("--workdir", default=str(Path.home() / ".cache" / "lorafleet-bench"), help="where synthetic weights are written")
    p.add_argument("--workload", help="replay this JSONL workload instead of generating one")
    p.add_argument("--url", help="benchmark a running server at this URL instead of an in-process engine")
    p.add_argument("--base-model", help="with --url: the served base model's name (default: the first entry of /v1/models)")
    p.add_argument("--api-key", help="with --url: bearer key")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="SLO on time to first token, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.5, help="SLO on time per output token, seconds")
    p.add_argument("--json", help="write the full summary as JSON here")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from tqdm import tqdm

    from runtime.bench.replay import replay_http, served_base_model
    from runtime.bench.summary import summarize, table
    from runtime.bench.suite import BenchSetup, host_tier_size, prepare, run_lorafleet
    from runtime.torch_threads import in_fresh_thread
    from runtime.bench.synthetic import LlamaShape
    from runtime.bench.workload import Workload, generate, spec_from_args

    try:
        workload = Workload.load(args.workload) if args.workload else generate(spec_from_args(args))
        shape = LlamaShape.sized(args.hidden, args.layers)
        host_cpu_loras = host_tier_size(args.max_loras, args.max_cpu_loras)
    except (ValueError, OSError) as err:
        print(f"lorafleet bench: {err}", file=sys.stderr)
        return 2
    bar = tqdm(total=len(workload.requests), desc="requests", unit="req")
    try:
        if args.url:
            base = args.base_model or served_base_model(args.url, args.api_key)
            result = asyncio.run(replay_http(args.url, base, workload.requests, "lorafleet-http", args.api_key, progress=bar.update))
        else:
            setup = BenchSetup(Path(args.workdir), shape, args.device, args.dtype, args.max_loras, host_cpu_loras,
                               max_lora_rank=max(64, max(workload.spec.ranks)), slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
            bar.set_description("preparing synthetic weights")
            # Not on this thread: its OpenMP team would slow the engine's steps (runtime/torch_threads.py).
            model_dir, adapters = in_fresh_thread(prepare)(workload, setup)
            bar.set_description("requests")
            result = run_lorafleet(workload, setup, model_dir, adapters, progress=bar.update)
    finally:
        bar.close()
    summary = summarize(result, args.slo_ttft, args.slo_tpot)
    print(table([summary]))
    if summary["cache"]["device_hit_rate"] is not None:
        print(f"adapter device hit rate {summary['cache']['device_hit_rate']:.2f}, swaps {summary['adapter_swaps']}")
    elif args.url:
        print("adapter swaps and cache hits: not measured over HTTP (see the server's /metrics)")
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": {"spec": workload.spec.__dict__}, "summary": summary}, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0 if summary["requests_failed"] == 0 else 1
