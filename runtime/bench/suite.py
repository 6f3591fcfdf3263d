"""One benchmark run: synthetic model + adapters for a workload, lorafleet and its baselines.

Baselines, measured in the same process right after lorafleet:
  (a) ``no-adapter``: the same engine and requests with every adapter removed (the
      upper bound; the ratio to it is the multi-LoRA tax);
  (b) ``per-request-loop``: the same engine, one request at a time in arrival order
      (no batching, so no grouping across adapters);
  (c) ``transformers+peft``: PEFT's mixed-adapter ``generate`` (see peft_baseline.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from runtime.bench.replay import ReplayResult, replay_engine
from runtime.bench.synthetic import ATTENTION, LlamaShape, build_random_adapter, build_random_llama
from runtime.config import DEFAULT_HOST_LORAS, EngineConfig


@dataclass(frozen=True)
class BenchSetup:
    workdir: Path
    shape: LlamaShape = LlamaShape()
    device: str = "cpu"
    dtype: str = "float32"
    max_loras: int = 8
    max_cpu_loras: int | None = None  # None: the engine's default, max(32, max_loras)
    max_lora_rank: int = 64
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None  # None: the engine's default for the device (EngineConfig.for_backend)
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.5
    targets: tuple[str, ...] = ATTENTION
    max_cpu_lora_bytes: int | None = None  # None: no byte bound on the host tier


def add_engine_pair_arguments(p: Any, rounds: int) -> None:
    """The flags of the scripts that step two engines in turn on one synthetic llama
    (``benchmarks/packed_weights.py``, ``benchmarks/step_budget.py``): model shape, slots, rounds,
    base-only, dtype, workdir and JSON output."""
    p.add_argument("--hidden", type=int, default=512, help="model hidden size, a multiple of 64 (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default: %(default)s)")
    p.add_argument("--max-loras", type=int, default=8, help="device adapter slots (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=rounds, help="rounds, each engine pair built afresh; the median is printed (default: %(default)s)")
    p.add_argument("--base-only", action="store_true", help="every request on the base model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and activations (default: %(default)s)")
    p.add_argument("--workdir", default=None, help="synthetic weights folder (default: a temporary one, removed at the end)")
    p.add_argument("--json", help="also write the rounds and the median here")


def full_warmup_device(device: str) -> Optional[str]:
    """The backend an in-process run on ``device`` resolves to, when it warms up on the whole workload
    before timing (every backend but the CPU's: the first launch of each Triton kernel variant compiles
    it, steps of 0.7-1.6 s on an H200); None on the CPU, which compiles nothing."""
    from backends import resolve_name

    resolved = resolve_name(device)
    return None if resolved == "cpu" else resolved


def host_tier_size(max_loras: int, max_cpu_loras: int | None) -> int:
    """``--max-cpu-loras``, or max(32, max_loras) when not given; below max_loras is an error
    (the host tier backs every device slot), never silently raised."""
    if max_cpu_loras is None:
        return max(DEFAULT_HOST_LORAS, max_loras)
    if max_cpu_loras < max_loras:
        raise ValueError(f"--max-cpu-loras {max_cpu_loras} is below --max-loras {max_loras}: the host tier must hold every device adapter")
    return max_cpu_loras


def prepare(workload: Any, setup: BenchSetup) -> tuple[Path, dict[str, Path]]:
    """Write (or reuse) the synthetic base and one adapter folder per adapter the requests use.

    A zipf workload over 500 adapters uses far fewer (48 requests: 33); building the others
    would only cost time and disk (about 16 MB each at hidden 2048). Each adapter's seed
    depends on its place among all the workload's adapters, so a folder is the same whichever
    requests use it."""
    model_dir = setup.workdir / f"llama-h{setup.shape.hidden_size}-l{setup.shape.num_hidden_layers}"
    if not (model_dir / "config.json").is_file():
        build_random_llama(model_dir, setup.shape)
    used = {r.adapter for r in workload.requests if r.adapter is not None}
    adapters = {}
    for i, (name, rank) in enumerate(sorted(workload.adapter_ranks.items())):
        if name not in used:
            continue
        # The model shape is in the folder name too, so runs of different shapes can share a workdir.
        path = setup.workdir / "adapters" / f"{model_dir.name}-{name}-r{rank}-{'-'.join(setup.targets)}"
        if not (path / "adapter_config.json").is_file():
            build_random_adapter(path, setup.shape, rank, seed=1000 + i, targets=setup.targets)
        adapters[name] = path
    return model_dir, adapters


def engine_config(setup: BenchSetup, model_dir: Path, **overrides: Any) -> EngineConfig:
    values = dict(model=str(model_dir), device=setup.device, dtype=setup.dtype, max_loras=setup.max_loras,
                  max_cpu_loras=setup.max_cpu_loras, max_cpu_lora_bytes=setup.max_cpu_lora_bytes, max_lora_rank=setup.max_lora_rank,
                  max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens)
    values.update(overrides)
    return EngineConfig(**values)


def _peak_rss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run_lorafleet(workload: Any, setup: BenchSetup, model_dir: Path, adapters: dict[str, Path], label: str = "lorafleet",
                  without_adapters: bool = False, one_at_a_time: bool = False, progress: Optional[Callable[[], None]] = None,
                  **config_overrides: Any) -> ReplayResult:
    from runtime.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(engine_config(setup, model_dir, **config_overrides))
    try:
        if not without_adapters:
            for name in sorted({r.adapter for r in workload.requests if r.adapter is not None}):
                engine.register_adapter(name, str(adapters[name]))
        requests = workload.requests
        if without_adapters:
            requests = tuple(dataclasses.replace(r, adapter=None, rank=None) for r in requests)
        if one_at_a_time:
            result = asyncio.run(_one_at_a_time(engine, requests, label, progress))
        else:
            result = asyncio.run(replay_engine(engine, requests, label, progress=progress))
        result.memory = dict(engine.engine.runner.memory_report())
        result.memory["pool_device_bytes_in_use_end"] = result.snapshot.get("pool_device_bytes_in_use", 0)
        result.memory["pool_device_bytes_if_padded_end"] = result.snapshot.get("pool_device_bytes_if_padded", 0)
        result.peak_rss_bytes = _peak_rss()
        return result
    finally:
        engine.shutdown()


async def _one_at_a_time(engine: Any, requests: Any, label: str, progress: Optional[Callable[[], None]]) -> ReplayResult:
    """Baseline (b): each request runs alone, in arrival order, arrival times ignored."""
    import time

    records = []
    metrics: dict[str, Any] = {}  # request id -> RequestMetrics, one observer for every sub-replay
    engine.add_observer(lambda m: metrics.__setitem__(m.request_id, m))
    start = time.perf_counter()
    for req in sorted(requests, key=lambda r: r.arrival_s):
        shifted = dataclasses.replace(req, arrival_s=0.0)
        sub = await replay_engine(engine, [shifted], f"{label}-{req.index}", metrics=metrics)
        records.extend(sub.records)
        if progress is not None:
            progress()
    return ReplayResult(label, records, time.perf_counter() - start, snapshot=engine.snapshot())


def offline_throughput(config: EngineConfig, adapters: dict[str, Path], jobs: list[tuple[Any, Optional[str]]], params: Any) -> dict[str, Any]:
    """One LLMEngine run to completion with every (prompt, adapter) job submitted up front.

    throughput = generated tokens / wall time of the step loop (adapter registration and
    model load excluded).
    """
    import time

    from runtime.engine import LLMEngine

    engine = LLMEngine(config)
    try:
        for name, path in adapters.items():
            engine.register_adapter(name, str(path))
        for i, (prompt, adapter) in enumerate(jobs):
            engine.add_request(f"r{i}", prompt, params, adapter)
        start = time.perf_counter()
        tokens = 0
        while engine.has_unfinished():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        wall = time.perf_counter() - start
        snap = engine.snapshot()
    finally:
        engine.close()
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1), "steps": snap["steps"], "pool": snap["pool"]}


def stepped_in_turn(runs: dict[str, tuple[EngineConfig, dict[str, Path], list[tuple[Any, Optional[str], Any]]]],
                    prepare: Optional[dict[str, Callable[[Any], None]]] = None, keep_token_ids: bool = False) -> dict[str, dict[str, Any]]:
    """Runs side by side in one process: one LLMEngine per run, stepped in turn until all finish.

    ``runs``: name -> (engine config, adapter folders to register, jobs (prompt, adapter or
    None, SamplingParams)), every job submitted up front. tokens/s of a run = its generated
    tokens / the time spent in its own steps, so machine drift hits every run alike, step by
    step, instead of run by run (on the 2-core dev machine sequential runs of one config drift
    by up to 1.36x). Disk loads that can start up front finish before the first timed step (the
    loader thread would otherwise run during another engine's steps); loads queued behind a full
    host tier (more adapters in the workload than ``max_cpu_loras``) happen during the run, as
    do host -> device copies. Run order is the dict's: callers alternate it between rounds.
    Each run also reports its adapter pool's counters over the whole run: ``host_loads`` (disk ->
    host), ``device_loads`` (host -> device) and ``adapters_loaded`` (distinct adapter names
    loaded onto the device); all 0 for a run without adapters.
    ``prepare``: run name -> a function called with that run's engine once every request is
    submitted, before the first step (e.g. to swap its weights). ``keep_token_ids``: each run
    also reports ``token_ids``, request id -> the tokens it generated.
    """
    import time

    from runtime.engine import LLMEngine

    engines: dict[str, LLMEngine] = {}
    try:
        for name, (config, adapters, jobs) in runs.items():
            engine = engines[name] = LLMEngine(config)
            submit_all(engine, adapters, jobs)
        for name, fn in (prepare or {}).items():
            fn(engines[name])
        busy, tokens, steps = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0), dict.fromkeys(engines, 0)
        token_ids: dict[str, dict[str, list[int]]] = {name: {} for name in engines}
        while any(e.has_unfinished() for e in engines.values()):
            for name, engine in engines.items():
                if engine.has_unfinished():
                    start = time.perf_counter()
                    outputs = engine.step()
                    busy[name] += time.perf_counter() - start
                    tokens[name] += sum(len(o.new_token_ids) for o in outputs)
                    steps[name] += 1
                    if keep_token_ids:
                        for o in outputs:
                            token_ids[name].setdefault(o.request_id, []).extend(o.new_token_ids)
        loads = {name: list(engine.pool.counters.values()) for name, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
    return {name: {"tokens": tokens[name], "steps": steps[name], "busy_s": round(busy[name], 6),
                   "tokens_per_s": round(tokens[name] / busy[name], 1) if busy[name] else 0.0,
                   "host_loads": sum(c.loads for c in loads[name]), "device_loads": sum(c.device_loads for c in loads[name]),
                   "adapters_loaded": sum(1 for c in loads[name] if c.device_loads),
                   **({"token_ids": token_ids[name]} if keep_token_ids else {})} for name in engines}


def submit_all(engine: Any, adapters: dict[str, Path], jobs: list[tuple[Any, Optional[str], Any]]) -> None:
    """Register ``adapters``, add every job as request ``r<i>``, then wait for the adapter reads
    that can start now, so they finish before the first timed step; a read queued behind a full
    host tier happens during the run's steps."""
    for adapter, path in adapters.items():
        engine.register_adapter(adapter, str(path))
    for i, (prompt, adapter, params) in enumerate(jobs):
        engine.add_request(f"r{i}", prompt, params, adapter)
    engine.pool.poll()
    while engine.pool.load_futures():
        engine.pool.wait_for_load(timeout=0.05)
        engine.pool.poll()


def workload_jobs(workload: Any, adapters: dict[str, Path], without_adapters: bool = False) -> tuple[dict[str, Path], list[tuple[Any, Optional[str], Any]]]:
    """(adapter folders the workload uses, its requests as ``stepped_in_turn`` jobs), greedy
    with ``ignore_eos`` as in the replays; ``without_adapters``: every request on the base model."""
    from runtime.bench.replay import sampling_params

    if without_adapters:
        return {}, [(r.prompt, None, sampling_params(r.output_tokens)) for r in workload.requests]
    used = sorted({r.adapter for r in workload.requests if r.adapter is not None})
    return {name: adapters[name] for name in used}, [(r.prompt, r.adapter, sampling_params(r.output_tokens)) for r in workload.requests]
