"""How many engine steps the scheduler takes for an offline workload, replayed on a tiny model.

    python benchmarks/schedule_steps.py --sweep-adapters 16,500 --num-requests 384 --input-len 8,16 \
        --output-len 16,32 --ranks 8,16 [--max-loras 8] [--json]

The schedule does not depend on the model's size: the KV pool holds ``max_num_seqs`` whole
sequences and the LoRA pool ``max_loras`` slots whatever the hidden size, and every request is
greedy with ``ignore_eos``. So a one-layer, hidden-64 llama replays a benchmark workload's
schedule step for step in seconds (the 384-request sweep of ``benchmarks/cpu/adapter_sweep.sh``:
550 and 299 steps; 550 and 301, as at hidden 512, before the twenty-fourth session's change to
drains): a quick loop for trying scheduler changes before timing them.
As in the timed runs, the adapter reads that can start before the first step finish first;
those queued behind a full host tier (``--max-cpu-loras``) happen while it steps, so a slow disk
could shift a schedule that needs them.

For each adapter count it prints the steps taken, the fewest any schedule needs
(``runtime.bench.slot_bound``), the distinct adapters used, and the step at which the last
request of the most and of the least popular adapters got its first token (fairness in steps).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench import suite  # noqa: E402
from runtime.bench.slot_bound import slot_bound  # noqa: E402
from runtime.bench.suite import BenchSetup, engine_config, host_tier_size, workload_jobs  # noqa: E402
from runtime.bench.synthetic import LlamaShape  # noqa: E402
from runtime.bench.workload import Workload, add_spec_arguments, generate, spec_from_args  # noqa: E402

TINY = LlamaShape.sized(64, 1)


def replay_steps(workload: Workload, setup: BenchSetup) -> dict[str, Any]:
    """Run ``workload`` offline (every request at t=0) on ``setup``'s tiny model; count steps."""
    from runtime.engine import LLMEngine

    workload = workload.all_at_once()
    requests = workload.requests
    model_dir, adapters = suite.prepare(workload, setup)
    used, jobs = workload_jobs(workload, adapters)
    engine = LLMEngine(engine_config(setup, model_dir))
    try:
        suite.submit_all(engine, used, jobs)  # as the timed stepped_in_turn runs do
        first_token: dict[str, int] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids and out.request_id not in first_token:
                    first_token[out.request_id] = engine.steps
        steps = engine.steps
    finally:
        engine.close()
    bound = slot_bound(((r.adapter, r.output_tokens) for r in requests), setup.max_loras, setup.max_num_seqs)
    popularity = collections.Counter(r.adapter for r in requests if r.adapter is not None)
    firsts = collections.defaultdict(list)
    for i, r in enumerate(requests):
        firsts[r.adapter].append(first_token[f"r{i}"])
    fewest = min(popularity.values(), default=0)
    most = popularity.most_common(1)[0][0] if popularity else None
    return {
        "adapters": workload.spec.num_adapters,
        "requests": len(requests),
        "steps": steps,
        "slot_bound": bound.as_dict(),
        "distinct_adapters": len(popularity),
        "last_first_token_step_most_popular": max(firsts[most]) if most is not None else None,
        "last_first_token_step_least_popular": max((max(firsts[a]) for a, n in popularity.items() if n == fewest), default=None),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_arguments(p)
    p.add_argument("--sweep-adapters", default="16,500", help="adapter counts to replay, comma-separated (default: %(default)s)")
    p.add_argument("--max-loras", type=int, default=8, help="device adapter slots (default: %(default)s)")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="host-tier adapters (default: max(32, --max-loras))")
    p.add_argument("--max-num-seqs", type=int, default=32, help="rows per step (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="tokens per step (default: %(default)s)")
    p.add_argument("--workdir", default=None, help="synthetic weights folder (default: a temporary one, removed at the end)")
    p.add_argument("--json", action="store_true", help="print one JSON object per adapter count instead of a table")
    a = p.parse_args(argv)
    try:
        spec = spec_from_args(a)
        max_cpu_loras = host_tier_size(a.max_loras, a.max_cpu_loras)
    except ValueError as err:
        p.error(str(err))
    try:
        counts = [int(x) for x in a.sweep_adapters.split(",")]
    except ValueError:
        p.error(f"--sweep-adapters: expected comma-separated integers, got {a.sweep_adapters!r}")
    if any(n < 1 for n in counts):
        p.error(f"--sweep-adapters: counts must be >= 1, got {a.sweep_adapters}")
    with tempfile.TemporaryDirectory(prefix="schedule-steps-") as scratch:
        setup = BenchSetup(Path(a.workdir or scratch), TINY, max_loras=a.max_loras, max_cpu_loras=max_cpu_loras,
                           max_lora_rank=max(64, max(spec.ranks)), max_num_seqs=a.max_num_seqs,
                           max_num_batched_tokens=a.max_num_batched_tokens)  # fmt: skip
        for n in counts:
            result = replay_steps(generate(dataclasses.replace(spec, num_adapters=n)), setup)
            if a.json:
                print(json.dumps(result))
            else:
                b = result["slot_bound"]
                print(f"{n:>5} adapters, {result['requests']} requests: {result['steps']} steps (fewest possible {b['lower_bound_steps']}, "
                      f"{result['distinct_adapters']} distinct adapters); last first token of the most / least popular adapter at "
                      f"step {result['last_first_token_step_most_popular']} / {result['last_first_token_step_least_popular']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
