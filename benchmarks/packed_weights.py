"""Packed vs plain base weights on the CPU, end to end: two engines stepped in turn on one workload.

    python benchmarks/packed_weights.py [workload flags] [--hidden 512] [--layers 4] [--max-loras 8] \
        [--rounds 6] [--base-only] [--dtype float32|bfloat16] [--max-num-batched-tokens N] [--json FILE]

Both engines load the same synthetic llama. In "packed" every projection (and an untied LM head)
that oneDNN can take is packed (``runtime.models.dense.pack_weight(float32=True)``), whatever the
CPU; in "plain" every packed weight is unpacked again (``to_dense``), so every call is
``F.linear``'s (MKL). These are the two kernels ``EngineConfig.cpu_gemm`` chooses between
(``onednn``, ``mkl``); by default (``auto``) the engine packs float32 wherever torch has oneDNN, and
bf16 wherever the CPU runs it natively; the JSON records which it would take here. Every request is
submitted up front (offline, greedy, ``ignore_eos``) and the two engines take one step each in
turn, the order swapped every round, so machine drift hits both alike. tokens/s of an engine = its
tokens / the time inside its own steps; the script prints packed / plain per round and the median,
and exits 1 if the two engines' tokens differ (they must not: only float rounding differs, and
greedy decoding of the synthetic model has wide margins; a difference is reported, not hidden).
``--base-only`` drops the adapters (every request on the base model). ``--dtype bfloat16`` runs
both engines in bf16, where packing needs a CPU that runs bf16 natively in oneDNN
(``runtime.models.dense.PACKED_BFLOAT16``); elsewhere nothing is packed and the script says so and
exits 2. ``--rate`` and ``--cv`` are refused: every request arrives at once.
``--max-num-batched-tokens`` sets both engines' step budget (default: the engine's own for the CPU,
``EngineConfig.for_backend``); the JSON records the budget used.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench import suite  # noqa: E402
from runtime.bench.suite import BenchSetup, add_engine_pair_arguments, engine_config, host_tier_size, workload_jobs  # noqa: E402
from runtime.bench.synthetic import LlamaShape  # noqa: E402
from runtime.bench.workload import add_spec_arguments, generate, offline_spec_problems, spec_from_args  # noqa: E402
from runtime.bench.machine import describe as describe_machine  # noqa: E402
from runtime.models import dense  # noqa: E402
from runtime.models.dense import PACKED_BFLOAT16, pack_weight  # noqa: E402
from runtime.torch_threads import in_fresh_thread  # noqa: E402


def unpack(engine: Any) -> int:
    """Turn ``engine``'s packed weights (projections, and an untied LM head of 2^18 elements or
    more) back into plain tensors; how many there were."""
    model, n = engine.runner.model, 0
    for layer in model.layers:
        for lin in layer.projections.values():
            if getattr(lin.weight, "is_mkldnn", False):
                lin.weight = lin.weight.to_dense()
                n += 1
    if getattr(model.lm_head, "is_mkldnn", False):
        model.lm_head = model.lm_head.to_dense()
        n += 1
    return n


def pack(engine: Any) -> int:
    """Pack every projection of ``engine`` (and an untied LM head) that oneDNN can take, on any CPU
    (``pack_weight(float32=True)``); how many are packed now."""
    model, n = engine.runner.model, 0
    for layer in model.layers:
        for lin in layer.projections.values():
            if not isinstance(lin.weight, torch.Tensor):  # an int8 weight: not packable
                continue
            if not lin.weight.is_mkldnn:  # not yet packed: pack it (a weight the engine packed stays as it is)
                lin.weight = pack_weight(lin.weight, float32=True)
            n += lin.weight.is_mkldnn
    if model.lm_head is not model.embed:
        if not model.lm_head.is_mkldnn:
            model.lm_head = pack_weight(model.lm_head, float32=True)
        n += model.lm_head.is_mkldnn
    return n


def one_round(setup: BenchSetup, model_dir: Path, used: dict[str, Path], jobs: list, packed_first: bool) -> dict[str, Any]:
    order = ("packed", "plain") if packed_first else ("plain", "packed")
    packed_count: list[int] = []
    runs = suite.stepped_in_turn({name: (engine_config(setup, model_dir), used, jobs) for name in order},
                                 prepare={"packed": lambda engine: packed_count.append(pack(engine)), "plain": unpack},
                                 keep_token_ids=True)  # fmt: skip
    packed, plain = runs["packed"], runs["plain"]
    return {"packed_weights": packed_count[0], "same_tokens": packed["token_ids"] == plain["token_ids"], "tokens": packed["tokens"],
            "packed_tokens_per_s": packed["tokens_per_s"], "plain_tokens_per_s": plain["tokens_per_s"],
            "packed_over_plain": round(packed["tokens_per_s"] / plain["tokens_per_s"], 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_arguments(p)
    add_engine_pair_arguments(p, rounds=6)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step, both engines (default: the engine's CPU default, max(256, max_num_seqs))")
    a = p.parse_args(argv)
    problems = offline_spec_problems(a)
    if problems:
        p.error("; ".join(problems))
    try:
        spec = spec_from_args(a)
        shape = LlamaShape.sized(a.hidden, a.layers)
    except ValueError as err:
        p.error(str(err))
    if a.rounds < 1 or a.max_loras < 1:
        p.error("--rounds and --max-loras must be at least 1")
    if a.max_num_batched_tokens is not None and a.max_num_batched_tokens < 1:
        p.error(f"--max-num-batched-tokens must be at least 1, got {a.max_num_batched_tokens}")
    if a.dtype == "bfloat16" and not PACKED_BFLOAT16:
        print("packed_weights: this CPU (or torch) has no native bfloat16 in oneDNN, so bf16 weights are never packed: nothing to compare",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="packed-weights-") as scratch:
        setup = BenchSetup(Path(a.workdir or scratch), shape, dtype=a.dtype, max_loras=a.max_loras, max_cpu_loras=host_tier_size(a.max_loras, None),
                           max_lora_rank=max(64, max(spec.ranks)), max_num_batched_tokens=a.max_num_batched_tokens)  # fmt: skip
        try:
            budget = engine_config(setup, setup.workdir).for_backend("cpu").max_num_batched_tokens
        except ValueError as err:  # a value EngineConfig refuses, said in its words
            p.error(str(err))
        workload = generate(spec).all_at_once()
        model_dir, adapters = suite.prepare(workload, setup)
        used, jobs = workload_jobs(workload, adapters, without_adapters=a.base_only)
        rounds = []
        for i in range(a.rounds):
            result = in_fresh_thread(one_round)(setup, model_dir, used, jobs, packed_first=i % 2 == 0)
            rounds.append(result)
            print(f"round {i + 1}/{a.rounds}: packed {result['packed_tokens_per_s']} tokens/s, plain {result['plain_tokens_per_s']}, "
                  f"packed / plain {result['packed_over_plain']:.3f}x ({result['packed_weights']} weights packed)", flush=True)
            if result["packed_weights"] == 0:
                print(f"packed_weights: no weight of this model can be packed (hidden {a.hidden}: every projection is below "
                      f"{dense.ONEDNN_MIN_WEIGHT} elements, or this torch cannot pack): the two engines are the same, nothing to compare",
                      file=sys.stderr)  # fmt: skip
                return 2
    median = statistics.median(r["packed_over_plain"] for r in rounds)
    print(f"packed / plain, stepped in turn (median of {a.rounds} rounds): {median:.3f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"hidden": a.hidden, "layers": a.layers, "dtype": a.dtype, "base_only": a.base_only,
                                            "max_num_batched_tokens": budget, "engine_float32": "onednn" if dense.float32_packed("auto") else "mkl",
                                            "machine": describe_machine(), "spec": dataclasses.asdict(workload.spec),
                                            "rounds": rounds, "median_packed_over_plain": median}, indent=1))
    if not all(r["same_tokens"] for r in rounds):
        print("the packed and plain engines generated different tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
