"""Two step token budgets side by side: two engines stepped in turn on one workload.

    python benchmarks/step_budget.py --budgets 256,1024 [workload flags] [--hidden 512] [--layers 4] \
        [--max-loras 8] [--rounds 5] [--base-only] [--dtype float32|bfloat16] [--json FILE]

``max_num_batched_tokens`` caps the tokens of one engine step (prompt chunks and decodes). Both
engines load the same synthetic llama and get the same requests, submitted up front (offline,
greedy, ``ignore_eos``); the only difference is the budget. They take one step each in turn, the
order swapped every round, so machine drift hits both alike. tokens/s of an engine = its tokens /
the time inside its own steps; the script prints A / B per round (from the unrounded times) and the median.

What it is for: the CPU default (``EngineConfig.for_backend``: max(256, max_num_seqs)) was chosen
with these comparisons (docs/benchmarks.md, "Step token budget on the CPU"). The workload flags
are ``benchmarks/serve.py``'s; ``benchmarks/cpu/run_all.sh``'s burst is ``--num-requests 48
--adapters 16 --popularity zipf --alpha 1 --input-len 8,16 --output-len 16,32 --ranks 8,16``, and one
long prompt is ``--num-requests 1 --input-len 190,190 --output-len 1,1`` (about 950 tokens in the
synthetic byte-level tokenizer). ``--rate`` and ``--cv`` are refused: every request arrives at once.

Different budgets cut prompts into different chunks, so float sums round differently; the report
counts the requests whose greedy tokens differ between the two engines (expected 0 in float32 on
the synthetic model, possible in bfloat16) rather than failing on them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench import suite  # noqa: E402
from runtime.bench.suite import BenchSetup, add_engine_pair_arguments, engine_config, host_tier_size, workload_jobs  # noqa: E402
from runtime.bench.machine import describe as describe_machine  # noqa: E402
from runtime.bench.synthetic import LlamaShape  # noqa: E402
from runtime.bench.workload import add_spec_arguments, generate, offline_spec_problems, spec_from_args  # noqa: E402
from runtime.torch_threads import in_fresh_thread  # noqa: E402


def parse_budgets(text: str) -> tuple[int, int]:
    """``A,B``: two different step budgets of at least 1 token."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--budgets: expected two integers A,B, got {text!r}") from None
    if len(values) != 2 or min(values) < 1 or values[0] == values[1]:
        raise ValueError(f"--budgets: expected two different budgets of at least 1 token, A,B, got {text!r}")
    return values  # type: ignore[return-value]


def one_round(setup: BenchSetup, model_dir: Path, used: dict[str, Path], jobs: list, budgets: tuple[int, int], a_first: bool) -> dict[str, Any]:
    """One pair of fresh engines, budget A and budget B, stepped in turn."""
    names = [f"budget {b}" for b in budgets]
    order = names if a_first else names[::-1]
    configs = {name: engine_config(setup, model_dir, max_num_batched_tokens=b) for name, b in zip(names, budgets)}
    runs = suite.stepped_in_turn({name: (configs[name], used, jobs) for name in order}, keep_token_ids=True)
    a, b = runs[names[0]], runs[names[1]]
    differ = sum(1 for rid, ids in a["token_ids"].items() if b["token_ids"].get(rid) != ids)
    return {"tokens": a["tokens"], "steps": [a["steps"], b["steps"]], "busy_s": [a["busy_s"], b["busy_s"]],
            "tokens_per_s": [a["tokens_per_s"], b["tokens_per_s"]], "requests_with_other_tokens": differ,
            # From the unrounded times: tokens_per_s is rounded to 0.1, too coarse for one long prompt's ~5 tokens/s.
            "a_over_b": round((a["tokens"] / a["busy_s"]) / (b["tokens"] / b["busy_s"]), 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_arguments(p)
    p.add_argument("--budgets", required=True, metavar="A,B", help="the two max_num_batched_tokens values compared, e.g. 256,1024")
    add_engine_pair_arguments(p, rounds=5)
    p.add_argument("--max-num-seqs", type=int, default=32, help="running sequences per step, both engines (default: %(default)s)")
    a = p.parse_args(argv)
    # Everything that can be refused is refused before any weights are written.
    problems = offline_spec_problems(a)
    if problems:
        p.error("; ".join(problems))
    try:
        budgets = parse_budgets(a.budgets)
        spec = spec_from_args(a)
        shape = LlamaShape.sized(a.hidden, a.layers)
    except ValueError as err:
        p.error(str(err))
    if a.rounds < 1 or a.max_loras < 1 or a.max_num_seqs < 1:
        p.error("--rounds, --max-loras and --max-num-seqs must be at least 1")
    with tempfile.TemporaryDirectory(prefix="step-budget-") as scratch:
        setup = BenchSetup(Path(a.workdir or scratch), shape, dtype=a.dtype, max_loras=a.max_loras, max_cpu_loras=host_tier_size(a.max_loras, None),
                           max_lora_rank=max(64, max(spec.ranks)), max_num_seqs=a.max_num_seqs)  # fmt: skip
        workload = generate(spec).all_at_once()
        model_dir, adapters = suite.prepare(workload, setup)
        used, jobs = workload_jobs(workload, adapters, without_adapters=a.base_only)
        rounds = []
        for i in range(a.rounds):
            r = in_fresh_thread(one_round)(setup, model_dir, used, jobs, budgets, a_first=i % 2 == 0)
            rounds.append(r)
            print(f"round {i + 1}/{a.rounds}: budget {budgets[0]} {r['tokens_per_s'][0]} tokens/s ({r['steps'][0]} steps, {r['busy_s'][0]:.3f} s), "
                  f"budget {budgets[1]} {r['tokens_per_s'][1]} ({r['steps'][1]} steps, {r['busy_s'][1]:.3f} s), A / B {r['a_over_b']:.3f}x", flush=True)
    median = statistics.median(r["a_over_b"] for r in rounds)
    print(f"budget {budgets[0]} / budget {budgets[1]}, stepped in turn (median of {a.rounds} rounds): {median:.3f}x")
    differ = max(r["requests_with_other_tokens"] for r in rounds)
    if differ:
        print(f"note: up to {differ} of {len(jobs)} requests generated other greedy tokens under the two budgets "
              "(prompt chunks of other sizes round differently)")
    if a.json:
        Path(a.json).write_text(json.dumps({"budgets": list(budgets), "machine": describe_machine(), "hidden": a.hidden, "layers": a.layers, "dtype": a.dtype,
                                            "base_only": a.base_only, "max_num_seqs": a.max_num_seqs, "spec": dataclasses.asdict(workload.spec),
                                            "rounds": rounds, "median_a_over_b": median}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
