"""Ray Serve: adapter-affinity routing vs adapter-blind routing over the same replicas.

    python benchmarks/ray_affinity.py --replicas 2 --adapters 50 --alpha 1 --requests 300 --concurrency 8

One application, N replicas (each with its own engine and adapter pool). The same
request sequence (adapter k drawn with probability ~ 1/k^alpha, Zipf) is sent twice
from the driver through ``ReplicaSetEngine``: once with ``multiplexed_model_id`` =
adapter (affinity: Serve prefers replicas that hold it) and once without (adapter-blind:
Serve's default power-of-two-choices on queue length, the round-robin-like baseline).

Reported per mode: throughput (requests/s, generated tokens/s), the hit rate (share of
requests whose adapter was on device or in the host tier of the replica that served it)
and adapter swaps = disk loads into a replica's host tier (``loads``) and host -> device
copies (``device_loads``), summed over replicas, measured as deltas over the phase.
Without --model, a tiny random Llama and random PEFT adapters are built in a temp folder.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def zipf_sequence(n_adapters: int, alpha: float, n_requests: int, seed: int) -> list[str]:
    """Adapter k (1-based) with probability proportional to 1 / k^alpha."""
    rng = random.Random(seed)
    names = [f"ad{k:03d}" for k in range(n_adapters)]
    weights = [1.0 / (k + 1) ** alpha for k in range(n_adapters)]
    return rng.choices(names, weights=weights, k=n_requests)


def pool_counters(registry: Any, wait_s: float = 10.0, poll_s: float = 0.1) -> dict[str, float]:
    """The live replicas' pool counters, summed. A replica whose report the registry does not hold
    yet (snapshot None: it restarted, and the replica's whole report is on its way) is waited for
    (up to ``wait_s``, then RuntimeError): counted as 0, it made the phase's delta wrong."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        live = ray.get(registry.live_replicas.remote())
        missing = sorted(rid for rid, status in live.items() if status["snapshot"] is None)
        if not missing:
            break
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the registry holds no report of replica(s) {missing} after {wait_s:g} s; cannot sum their counters")
        time.sleep(poll_s)
    total = {"loads": 0.0, "device_loads": 0.0, "host_evictions": 0.0}
    for status in live.values():
        for counters in status["snapshot"].get("adapters", {}).values():
            for key in total:
                total[key] += counters.get(key, 0)
    return total


def run_phase(engine: Any, registry: Any, sequence: list[str], concurrency: int, max_tokens: int) -> dict[str, Any]:
    from runtime.request import SamplingParams

    locations: list[str] = []
    engine.add_observer(lambda m: locations.append(m.adapter_location))
    time.sleep(1.0)  # let heartbeats carry the counters up to now
    before = pool_counters(registry)
    tokens = 0
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def worker(queue: asyncio.Queue) -> None:
        nonlocal tokens
        while not queue.empty():
            i, adapter = queue.get_nowait()
            async for out in engine.generate(f"{engine.routing}-{i}", "the quick brown fox jumps", params, adapter):
                last = out
            tokens += len(last.token_ids)

    async def run() -> float:
        queue: asyncio.Queue = asyncio.Queue()
        for item in enumerate(sequence):
            queue.put_nowait(item)
        start = time.perf_counter()
        await asyncio.gather(*(worker(queue) for _ in range(concurrency)))
        return time.perf_counter() - start

    elapsed = asyncio.run(run())
    time.sleep(1.0)
    after = pool_counters(registry)
    hits = sum(loc in ("device", "host") for loc in locations)
    return {
        "routing": engine.routing,
        "requests": len(sequence),
        "seconds": round(elapsed, 2),
        "requests_per_s": round(len(sequence) / elapsed, 2),
        "tokens_per_s": round(tokens / elapsed, 1),
        "hit_rate": round(hits / max(1, len(locations)), 3),
        "disk_loads": int(after["loads"] - before["loads"]),
        "device_loads": int(after["device_loads"] - before["device_loads"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder; default: a tiny random Llama built in a temp folder")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--adapters", type=int, default=50)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4, help="device slots per replica")
    p.add_argument("--max-cpu-loras", type=int, default=8, help="host tier per replica (= Serve's max_num_models_per_replica)")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs given to the local Ray")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    import ray
    from ray import serve

    from runtime.config import EngineConfig
    from runtime.distributed.application import NAMESPACE, REPLICA_DEPLOYMENT, ScaleOutConfig, deploy, stop
    from runtime.distributed.replica_set import ReplicaSetEngine
    from runtime.server.options import ServerOptions
    from tests.fixtures.tiny_models import build_adapter, build_tiny_model
    from tests.server_harness import free_port

    work = Path(tempfile.mkdtemp(prefix="lorafleet-ray-affinity-"))
    model = args.model or str(build_tiny_model(work / "model", "llama", seed=0))
    adapters = {
        f"ad{k:03d}": str(build_adapter(model, work / f"ad{k:03d}", r=4 + 4 * (k % 3), target_modules=["q_proj", "v_proj"], seed=1000 + k))
        for k in range(args.adapters)
    }
    cfg = ScaleOutConfig(
        engine=EngineConfig(model=model, device="cpu", max_loras=args.max_loras, max_lora_rank=16, max_cpu_loras=args.max_cpu_loras,
                            max_num_seqs=16, max_model_len=128, block_size=8, num_kv_blocks=256),
        server=ServerOptions(port=free_port()),
        num_replicas=args.replicas,
        registry_dir=str(work / "registry"),
        app_name="ray-affinity-bench",
        replica_resources={"num_cpus": 0},
        initial_adapters=tuple(adapters.items()),
    )
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    results = []
    try:
        deploy(cfg)
        registry = ray.get_actor(cfg.registry_name, namespace=NAMESPACE)
        handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, cfg.app_name)
        sequence = zipf_sequence(args.adapters, args.alpha, args.requests, args.seed)
        for routing in ("adapter_blind", "affinity"):
            engine = ReplicaSetEngine(handle, registry, model, "bench", 128, routing=routing)
            result = run_phase(engine, registry, sequence, args.concurrency, args.max_tokens)
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        stop(cfg)
        serve.shutdown()
        ray.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
