"""Engine step times on a fresh engine and again on the same requests, with and without adapters.

    python benchmarks/step_times.py --device cuda --dtype bfloat16 --hidden 2048 --layers 8 [--json OUT]

One LLMEngine per run (LoRA, then no adapters), two passes of the same offline workload each
(every request at t=0): pass 0 on the fresh engine, pass 1 the same requests again. Each step
is timed on its own (a step ends with its sampled tokens on the host, so no extra sync). It reports, per pass,
the steps, the mean step, the mean of the last 60 steps (decode of the longest requests) and
the slowest steps.

What it is for: costs that a per-shape cache hides on a warm engine. On an H200 (2026-11-30)
cuDNN's SDPA built a plan for every new attention shape, and pass 0's last 60 steps took
46.8-48.9 ms against 6-9 ms in pass 1; ``backends/cuda/attention.py`` now keeps SDPA off cuDNN,
and pass 0 took 6.3 ms (no adapters) and 11.4 ms (with). A pass 0 far slower than pass 1 in its
last steps means such a cache is back. Triton's first-launch compiles also land in the LoRA run's
pass 0 on a fresh machine (its slowest steps).

The workload flags are ``benchmarks/serve.py``'s (and their defaults the workload generator's);
``benchmarks/cuda/run_all.sh`` passes its serving step's workload (96 requests, 16 adapters, zipf
1, prompts of 16-64 words, 32-128 output tokens, seed 0) and step budget (1024 tokens), whose
weights the two steps share.
``--rate`` and ``--cv`` are refused: every request arrives at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench import suite  # noqa: E402
from runtime.bench.suite import BenchSetup, engine_config, host_tier_size, workload_jobs  # noqa: E402
from runtime.bench.synthetic import LlamaShape  # noqa: E402
from backends import availability, resolve_name  # noqa: E402
from runtime.bench.workload import add_spec_arguments, generate, offline_spec_problems, spec_from_args  # noqa: E402

LAST = 60  # steps averaged at the end of a pass
SLOWEST = 5  # slowest steps listed per pass


def pass_summary(times: list[float]) -> dict[str, Any]:
    """Step times (seconds) of one pass -> steps, mean, mean of the last ``LAST``, slowest, in ms."""
    tail = times[-LAST:]
    return {"steps": len(times), "mean_ms": round(1000 * sum(times) / len(times), 2),
            f"last{LAST}_mean_ms": round(1000 * sum(tail) / len(tail), 2),
            "slowest_ms": [round(1000 * t, 1) for t in sorted(times, reverse=True)[:SLOWEST]]}  # fmt: skip


def two_passes(setup: BenchSetup, model_dir: Path, adapters: dict[str, Path], workload: Any, base_only: bool) -> list[dict[str, Any]]:
    """Pass 0 on a fresh engine, pass 1 with the same requests on it again."""
    import torch

    from runtime.engine import LLMEngine

    def sync() -> None:
        if setup.device == "cuda":
            torch.cuda.synchronize()

    used, jobs = workload_jobs(workload, adapters, without_adapters=base_only)
    engine = LLMEngine(engine_config(setup, model_dir))
    passes = []
    try:
        for n in range(2):
            if n == 0:
                suite.submit_all(engine, used, jobs)  # adapter reads that can start up front finish before timing
            else:
                for i, (prompt, adapter, params) in enumerate(jobs):
                    engine.add_request(f"p1-{i}", prompt, params, adapter)
            times = []
            sync()
            while engine.has_unfinished():  # a step ends with its sampled tokens on the host: no sync needed
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            passes.append(pass_summary(times))
    finally:
        engine.close()
    return passes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_arguments(p)  # the workload flags, as benchmarks/serve.py's
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu", help="backend (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="(default: %(default)s)")
    p.add_argument("--hidden", type=int, default=512, help="synthetic llama hidden size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="synthetic llama layers (default: %(default)s)")
    p.add_argument("--max-loras", type=int, default=16, help="device adapter slots (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step, as benchmarks/serve.py's (default: the engine's, max(256, max_num_seqs) "
                        "on the cpu, max(2048, max_num_seqs) on a GPU/NPU)")
    p.add_argument("--workdir", default=None, help="synthetic weights folder, kept for later runs (default: a temporary one, removed)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    # Everything that can be refused is refused before any weights are written.
    problems = offline_spec_problems(a)
    if problems:
        p.error("; ".join(problems))
    if a.max_loras < 1:
        p.error(f"--max-loras: must be >= 1, got {a.max_loras}")
    if a.max_num_batched_tokens is not None and a.max_num_batched_tokens < 1:
        p.error(f"--max-num-batched-tokens: must be >= 1, got {a.max_num_batched_tokens}")
    if a.json and not Path(a.json).resolve().parent.is_dir():
        p.error(f"--json: the folder {Path(a.json).resolve().parent} does not exist")
    ok, reason = availability(resolve_name(a.device))
    if not ok:
        p.error(f"--device {a.device}: {reason}")
    try:
        spec = spec_from_args(a)
        shape = LlamaShape.sized(a.hidden, a.layers)
    except ValueError as err:
        p.error(str(err))
    with tempfile.TemporaryDirectory(prefix="step-times-") as scratch:
        workdir = Path(a.workdir) if a.workdir else Path(scratch)
        setup = BenchSetup(workdir, shape, a.device, a.dtype, max_loras=a.max_loras, max_cpu_loras=host_tier_size(a.max_loras, None),
                           max_num_batched_tokens=a.max_num_batched_tokens)
        workload = generate(spec).all_at_once()
        model_dir, adapters = suite.prepare(workload, setup)
        result: dict[str, Any] = {"device": a.device, "dtype": a.dtype, "shape": dataclasses.asdict(shape),
                                  "max_num_batched_tokens": a.max_num_batched_tokens, "workload": dataclasses.asdict(spec)}  # fmt: skip
        for label, base_only in (("lora", False), ("no_adapters", True)):
            result[label] = two_passes(setup, model_dir, adapters, workload, base_only)
            for n, summary in enumerate(result[label]):
                print(f"{label:12s} pass {n}: {summary['steps']} steps, mean {summary['mean_ms']} ms, "
                      f"last {LAST} {summary[f'last{LAST}_mean_ms']} ms, slowest {summary['slowest_ms']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
