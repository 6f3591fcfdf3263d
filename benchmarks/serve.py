"""Serving benchmark: lorafleet vs its baselines on one S-LoRA-style workload, plus sweeps and plots.

    python benchmarks/serve.py --out bench-out/cpu [--adapters 16] [--alpha 1] [--rate 4] ...

Runs, in this order and in one process (so the ratios are side by side):
  1. offline throughput (every request ready at t=0): lorafleet with the mixed adapters,
     (a) the same engine with no adapters, (b) a per-request loop, (c) transformers+PEFT;
     then lorafleet and (a) again with both engines stepped in turn in one process, each
     round, so machine drift hits both alike (``stepped_in_turn`` in summary.json);
  2. online replay at --rate (Poisson, or --cv for burstiness): TTFT/TPOT p50/p99,
     SLO attainment, per-adapter latency, TTFT by where the adapter was on arrival,
     adapter swaps and cache hit rates, memory split;
  3. sweeps: offline throughput vs number of adapters (zipf; --sweep-requests requests per run), with the steps each run took
     against the fewest that any schedule needs under --max-loras (runtime.bench.slot_bound),
     the most against the fewest adapters also stepped in turn, and p99 latency vs rate.
Writes summary.json, workload.jsonl and three PNG plots into --out, and prints tables. They are
written as .partial-NAME while the run goes and replace the folder's previous ones only when it
completes: a run that fails or is stopped leaves a previous run's results as they were.
records.jsonl holds the raw data behind every summarized run: one JSON object per request with
the run's label, its round (offline runs and the adapter sweep; null for the online runs) and
the request's RequestRecord fields (index, adapter, prompt/output tokens, client-side ttft, tpot
and latency, adapter_location, error, and the engine's own engine_ttft, null where not measured:
over HTTP and for PEFT).
With --url the online replay goes over HTTP to a running server instead (TTFT real); with
--spawn-server it goes over HTTP to a `lorafleet serve` this script starts with the run's own model,
adapters and limits (its log: OUT/server.log), after an untimed warm-up over HTTP.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends import availability, resolve_name  # noqa: E402
from runtime.bench import plots  # noqa: E402
from runtime.bench.machine import describe as describe_machine  # noqa: E402
from runtime.bench.peft_baseline import run_peft_in_subprocess  # noqa: E402
from runtime.bench.replay import ReplayResult, base_model_of, replay_http, served_base_model, served_models  # noqa: E402
from runtime.bench.server_process import ServerStartError, spawned_server  # noqa: E402
from runtime.commands.bench import LONG_REPLAY_S, SetupError, check_lengths, check_workdir, duration_text  # noqa: E402
from runtime.bench import suite  # noqa: E402
from runtime.bench.suite import BenchSetup, engine_config, host_tier_size, run_lorafleet, workload_jobs  # noqa: E402
from runtime.bench.slot_bound import slot_bound  # noqa: E402
from runtime.bench.summary import fairness as adapter_fairness, median, median_round, summarize, table, ttft_by_adapter  # noqa: E402
from runtime.bench.synthetic import LlamaShape  # noqa: E402
from runtime.bench.workload import Workload, add_spec_arguments, generate, ignored_spec_flags, spec_from_args  # noqa: E402
from runtime.config import ConfigError  # noqa: E402
from runtime.torch_threads import in_fresh_thread  # noqa: E402

# This process's torch work runs in threads that end with it, never on the main thread: an
# OpenMP team left there slows every AsyncLLMEngine replay after it (runtime/torch_threads.py).
prepare = in_fresh_thread(suite.prepare)
stepped_in_turn = in_fresh_thread(suite.stepped_in_turn)
BASELINES = ("no-adapter", "loop", "peft")
OUTPUTS = ("summary.json", "records.jsonl", "workload.jsonl", "per_adapter_ttft.png", "throughput_vs_adapters.png", "p99_vs_rate.png")


def in_turn_ratio(pairs: list[dict[str, dict]], num: str, den: str) -> float | None:
    """Median over rounds of num / den tokens/s from ``stepped_in_turn`` results; None if a
    denominator run produced no tokens."""
    if any(pr[den]["tokens_per_s"] <= 0 for pr in pairs):
        return None
    return median([pr[num]["tokens_per_s"] / pr[den]["tokens_per_s"] for pr in pairs])


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_arguments(p)
    p.add_argument("--out", required=True,
                   help="output folder for JSON and PNGs; a previous run's results there are replaced only once this run completes")
    p.add_argument("--workload", help="replay this saved JSONL workload (its spec replaces the workload options above)")
    p.add_argument("--workdir", default=None, help="synthetic weights folder (default OUT/weights)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the synthetic llama (head dim 64, intermediate 2 x hidden; default %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the synthetic llama (default %(default)s)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu", "auto"), help="backend for the in-process runs (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations of lorafleet and of the PEFT baseline (default float32 on every device; pass bfloat16 on a GPU, as benchmarks/cuda/run_all.sh does)")
    p.add_argument("--max-loras", type=int, default=8, help="distinct adapters in one step (device slots; default %(default)s)")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="host-tier adapters (default: max(32, --max-loras)); at least --max-loras")
    p.add_argument("--max-num-seqs", type=int, default=32, help="running sequences per step (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (default: the engine's, max(256, --max-num-seqs) on the cpu, max(2048, --max-num-seqs) on a GPU/NPU)")
    p.add_argument("--baselines", default="no-adapter,loop,peft", help="comma list of: no-adapter, loop, peft (or 'none'; default %(default)s)")
    p.add_argument("--loop-requests", type=int, default=None, help="requests for the per-request loop (it is slow; default 16)")
    p.add_argument("--peft-batch", type=int, default=None,
                   help="PEFT's static batch size (default: --max-num-seqs, the engine's batch cap, so both systems may batch "
                        "as many requests)")  # fmt: skip
    p.add_argument("--sweep-adapters", default="16,100,500", help="adapter counts for the throughput sweep ('' to skip; default %(default)s)")
    p.add_argument("--sweep-requests", type=int, default=None,
                   help="requests per run of the adapter sweep (default: --num-requests). A short burst is mostly ramp-up and "
                        "drain; with many more requests than slots the sweep measures a backlogged engine's steady state")
    p.add_argument("--sweep-rates", default=None,
                   help="arrival rates (requests/s) for the latency sweep, run in-process ('' to skip; default 1,2,4, "
                        "and none with --url)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="run the offline comparisons and the adapter sweep this many times in interleaved rounds; "
                        "tables show each run's median round, ratios are medians of within-round ratios (default %(default)s)")  # fmt: skip
    p.add_argument("--slo-ttft", type=float, default=2.0, help="SLO on time to first token, seconds (default %(default)s)")
    p.add_argument("--slo-tpot", type=float, default=0.5, help="SLO on time per output token, seconds (default %(default)s)")
    p.add_argument("--url", help="replay the online run against this running server (HTTP streaming)")
    p.add_argument("--base-model", help="with --url: the served base model's name (default: the /v1/models entry with parent null, else the first entry)")
    p.add_argument("--api-key", help="with --url: the server's bearer key (default: none)")
    p.add_argument("--spawn-server", action="store_true",
                   help="replay the online run over HTTP against a `lorafleet serve` started here with this run's model, adapters, "
                        "device and limits on a free local port (log: OUT/server.log); not with --url")  # fmt: skip
    a = p.parse_args()
    for flag, value in (("--max-loras", a.max_loras), ("--max-num-seqs", a.max_num_seqs), ("--layers", a.layers),
                        ("--max-num-batched-tokens", a.max_num_batched_tokens)):
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--slo-ttft", a.slo_ttft), ("--slo-tpot", a.slo_tpot)):
        if not 0 < value < float("inf"):
            p.error(f"{flag}: must be a positive number of seconds, got {value}")
    try:
        max_cpu_loras = host_tier_size(a.max_loras, a.max_cpu_loras)
    except ValueError as err:
        p.error(str(err))
    ok, reason = availability(resolve_name(a.device))
    if not ok:
        p.error(reason)
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    if a.spawn_server and a.url:
        p.error("--spawn-server and --url: the online replay goes to one server; give one of them")
    if a.spawn_server and importlib.util.find_spec("fastapi") is None:
        p.error("--spawn-server: the server needs fastapi and uvicorn, which this Python lacks (pip install -e .)")
    if a.spawn_server and a.max_num_batched_tokens is not None and a.max_num_batched_tokens < a.max_num_seqs:
        p.error(f"--spawn-server: lorafleet serve refuses --max-num-batched-tokens {a.max_num_batched_tokens} below --max-num-seqs "
                f"{a.max_num_seqs} (a step could not decode every running sequence)")
    if a.sweep_requests is not None and a.sweep_requests < 1:
        p.error(f"--sweep-requests must be >= 1, got {a.sweep_requests}")
    if a.sweep_rates is None:
        a.sweep_rates = "" if a.url else "1,2,4"
    elif a.sweep_rates and a.url:
        p.error("--sweep-rates: the arrival-rate sweep runs in-process only, not with --url; drop it (or pass '')")
    ignored = ignored_spec_flags(a)
    if ignored:
        p.error("; ".join(ignored))
    chosen = [] if a.baselines == "none" else a.baselines.split(",")
    unknown = [b for b in chosen if b not in BASELINES]
    if unknown or (not chosen and a.baselines != "none"):
        p.error(f"--baselines: {', '.join(map(repr, unknown)) or 'empty'} is not one of {', '.join(BASELINES)} (comma-separated), or 'none'")
    # A flag that the chosen runs never read is a mistake, not a no-op: say so rather than run without it.
    for flag, given, used, by in (
        ("--loop-requests", a.loop_requests is not None, "loop" in chosen, "the loop baseline"),
        ("--peft-batch", a.peft_batch is not None, "peft" in chosen, "the peft baseline"),
        ("--sweep-requests", a.sweep_requests is not None, bool(a.sweep_adapters), "--sweep-adapters"),
        ("--base-model", a.base_model is not None, a.url is not None, "--url"),
        ("--api-key", a.api_key is not None, a.url is not None, "--url"),
    ):
        if given and not used:
            p.error(f"{flag}: only used with {by}, which this run does not have; drop it")
    if a.loop_requests is None:
        a.loop_requests = 16
    if a.peft_batch is None:
        a.peft_batch = a.max_num_seqs
    if a.peft_batch < 1:
        p.error(f"--peft-batch must be >= 1, got {a.peft_batch}")
    if a.loop_requests < 1 and "loop" in chosen:
        p.error(f"--loop-requests must be >= 1 with the loop baseline, got {a.loop_requests}")
    if "peft" in chosen and a.device not in ("cpu", "cuda"):
        p.error(f"the PEFT baseline runs on cpu or cuda, not {a.device!r}: drop it with --baselines no-adapter,loop")

    out = Path(a.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {out}: is a file, not a folder")
    if a.workdir is not None:
        try:
            check_workdir(a.workdir)
        except SetupError as err:
            p.error(str(err))
    try:
        shape = LlamaShape.sized(a.hidden, a.layers)
    except ValueError as err:
        p.error(str(err))
    if a.workload:
        try:
            loaded: Workload | None = Workload.load(a.workload)
        except (ValueError, OSError, KeyError, TypeError) as err:
            p.error(f"--workload {a.workload}: {err}")
        spec = loaded.spec  # the sweeps vary this spec
    else:
        try:
            loaded, spec = None, spec_from_args(a)
        except ValueError as err:  # the message starts with the flag
            p.error(str(err))
    # The sweeps' workloads, checked now rather than after the main runs.
    try:
        counts = [int(x) for x in a.sweep_adapters.split(",")] if a.sweep_adapters else []
    except ValueError:
        p.error(f"--sweep-adapters: expected comma-separated adapter counts like 16,100,500, got {a.sweep_adapters!r}")
    try:
        rates = [float(x) for x in a.sweep_rates.split(",")] if a.sweep_rates else []
    except ValueError:
        p.error(f"--sweep-rates: expected comma-separated arrival rates like 1,2,4, got {a.sweep_rates!r}")
    for n in counts:
        try:
            dataclasses.replace(spec, num_adapters=n, popularity="zipf", num_requests=a.sweep_requests or spec.num_requests)
        except ValueError as err:
            p.error(f"--sweep-adapters {n}: {str(err).replace('num_adapters', 'adapters')}")
    for rate in rates:
        if not 0 <= rate < float("inf"):
            p.error(f"--sweep-rates: {rate} is not a finite rate >= 0")
    if a.workload and generate(spec) != loaded and (counts or rates):
        log(f"note: {a.workload} holds other requests than its spec generates; the sweeps regenerate from the spec")
    # The slot width fits every rank: the spec's (the sweeps regenerate from it) and the file's adapters' (it may be edited).
    setup = BenchSetup(Path(a.workdir) if a.workdir else out / "weights", shape, a.device, a.dtype, max_loras=a.max_loras,
                       max_cpu_loras=max_cpu_loras, max_lora_rank=max(64, *spec.ranks, *(loaded.adapter_ranks.values() if loaded else ())),
                       max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens, slo_ttft_s=a.slo_ttft,
                       slo_tpot_s=a.slo_tpot)
    try:
        config = engine_config(setup, setup.workdir / "model").for_backend(resolve_name(a.device))
    except ConfigError as err:  # "key: reason", the key an engine setting this script sets from a flag of the same name
        key, _, why = str(err).partition(": ")
        p.error(f"--{key.replace('_', '-')}: {why}" if key in ("max_loras", "max_cpu_loras", "max_num_seqs", "max_num_batched_tokens", "dtype", "device") else str(err))
    # The device's default step budget, spelt out: the summary records it, and a spawned server gets the same.
    setup = dataclasses.replace(setup, max_num_batched_tokens=config.max_num_batched_tokens)
    out.mkdir(parents=True, exist_ok=True)
    workload = loaded if loaded is not None else generate(spec)
    if a.url:  # the online replay comes last: find out now, not after the offline runs, whether the server can take it
        try:
            cards = served_models(a.url, a.api_key)
        except Exception as err:  # noqa: BLE001 - unreachable, not a server, wrong reply: one line either way
            hint = ("; check --api-key" if a.api_key else "; the server wants a key: pass --api-key") if " 401 " in str(err) else ""
            p.error(f"--url {a.url}: {type(err).__name__}: {err}{hint}")
        served = {c["id"] for c in cards}
        missing = sorted({r.adapter for r in workload.requests if r.adapter is not None} - served)
        if a.base_model is not None and a.base_model not in served:
            missing.insert(0, a.base_model)
        if missing:
            p.error(f"--url {a.url} does not serve {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (it serves "
                    f"{', '.join(sorted(served))}); serve adapters named like the workload's, or use `lorafleet bench --url ... "
                    f"--adapter-names` to map them onto the served ones")
        # Prompt + output must fit each model card's max_model_len: lorafleet bench's check (the server's /tokenize, else a bound).
        checked = argparse.Namespace(url=a.url, api_key=a.api_key, workload=a.workload, input_len=spec.input_len, output_len=spec.output_len)
        try:
            check_lengths(checked, list(workload.requests), a.base_model or base_model_of(cards), {str(c["id"]): c for c in cards})
        except SetupError as err:
            p.error(str(err))
    # Every output is written under a staged name and moved into place only when the run completes:
    # a run that fails or is stopped leaves the last complete run's files as they were (and its own
    # partial ones beside them), and a complete one never leaves the last run's plots next to its records.
    def staged(name: str) -> Path:
        return out / f".partial-{name}"

    for name in OUTPUTS:
        staged(name).unlink(missing_ok=True)  # an earlier failed run's
    workload.save(staged("workload.jsonl"))
    records_path = staged("records.jsonl")
    records_path.write_text("")

    def summarized(result: ReplayResult, round_: int | None = None) -> dict[str, Any]:
        """``summarize(result)``, after appending its per-request records to records.jsonl."""
        with records_path.open("a") as f:
            for rec in result.records:
                f.write(json.dumps({"label": result.label, "round": round_, **dataclasses.asdict(rec)}) + "\n")
        return summarize(result, a.slo_ttft, a.slo_tpot)

    baselines = set() if a.baselines == "none" else set(a.baselines.split(","))
    long_replay = f" (the online replay alone takes at least {duration_text(workload.arrival_span_s)})" if workload.arrival_span_s >= LONG_REPLAY_S else ""
    log(f"workload: {len(workload.requests)} requests, {spec.num_adapters} adapters ({spec.popularity}, alpha {spec.alpha}), rate {spec.rate}/s{long_replay}")
    model_dir, adapters = prepare(workload, setup)
    results: dict[str, object] = {"spec": dataclasses.asdict(spec), "setup": {k: str(v) for k, v in dataclasses.asdict(setup).items()},
                                  "machine": describe_machine()}  # this script's machine (also the server's, unless --url names another)
    if "peft" in baselines:
        results["peft_batch"] = a.peft_batch

    # 1. Offline throughput, side by side, in --repeats interleaved rounds.
    # Every system warms up untimed first. On the CPU: lorafleet on four requests, PEFT on one 2-token
    # batch (first-call initialisation: allocator, thread pools). Off it (suite.full_warmup_device),
    # both on the whole workload: Triton compiles each kernel variant on its first launch (tile sizes
    # follow segment lengths and ranks), and both stacks' SDPA may build per-shape plans.
    on_cpu = suite.full_warmup_device(a.device) is None
    off = workload.all_at_once()
    sub = dataclasses.replace(off, requests=off.requests[: a.loop_requests])
    runs = [("lorafleet offline", "lorafleet (mixed adapters)", lambda: run_lorafleet(off, setup, model_dir, adapters, "lorafleet offline"))]
    if "no-adapter" in baselines:
        runs.append(("(a) no adapters", "(a) same engine, no adapters",
                     lambda: run_lorafleet(off, setup, model_dir, adapters, "(a) no adapters", without_adapters=True)))  # fmt: skip
    if "loop" in baselines:
        runs.append(("(b) per-request loop", f"(b) per-request loop on the first {len(sub.requests)} requests",
                     lambda: run_lorafleet(sub, setup, model_dir, adapters, "(b) per-request loop", one_at_a_time=True)))  # fmt: skip
        runs.append(("lorafleet on loop subset", "lorafleet on the loop's subset",
                     lambda: run_lorafleet(sub, setup, model_dir, adapters, "lorafleet on loop subset")))  # fmt: skip
    if "peft" in baselines:
        runs.append(("(c) transformers+peft", f"(c) transformers + PEFT mixed-adapter generate, static batches of {a.peft_batch}",
                     lambda: run_peft_in_subprocess(model_dir, adapters, off.requests, a.peft_batch, "(c) transformers+peft", a.device, a.dtype,
                                                    full_warmup=not on_cpu)))  # fmt: skip
    warm = off.requests[:4] if on_cpu else off.requests
    log(f"warm-up: one untimed lorafleet run on {'the first 4 requests' if on_cpu else 'the whole workload'}")
    run_lorafleet(dataclasses.replace(off, requests=warm), setup, model_dir, adapters, "warm-up")
    rounds: list[dict[str, dict]] = []
    for r in range(a.repeats):
        rounds.append({})
        for label, what, fn in runs:
            log(f"offline: {what}" + (f" (round {r + 1}/{a.repeats})" if a.repeats > 1 else ""))
            rounds[-1][label] = summarized(fn(), r + 1)
    rows = [median_round([rd[label] for rd in rounds], "throughput_tokens_per_s") for label, _, _ in runs]
    by_label = {r["label"]: r for r in rows}

    def ratio(num: Any, den: Any, of: list[dict] = rounds) -> float | None:
        """Median of within-round throughput ratios; None if a denominator run produced nothing (every request failed)."""
        if any(rd[den]["throughput_tokens_per_s"] <= 0 for rd in of):
            return None
        return median([rd[num]["throughput_tokens_per_s"] / rd[den]["throughput_tokens_per_s"] for rd in of])

    ratios = {}
    if "(a) no adapters" in by_label:
        ratios["lorafleet / no-adapter"] = ratio("lorafleet offline", "(a) no adapters")
    if "(b) per-request loop" in by_label:
        ratios["lorafleet / per-request loop (same subset)"] = ratio("lorafleet on loop subset", "(b) per-request loop")
    if "(c) transformers+peft" in by_label:
        ratios["lorafleet / transformers+peft"] = ratio("lorafleet offline", "(c) transformers+peft")
    results["offline"] = rows
    results["offline_rounds_tokens_per_s"] = {label: [rd[label]["throughput_tokens_per_s"] for rd in rounds] for label, _, _ in runs}
    results["ratios"] = ratios
    print(table(rows))
    if a.repeats > 1:
        for label, per_round in results["offline_rounds_tokens_per_s"].items():
            print(f"  {label:<30} tok/s by round: " + ", ".join(f"{v:.1f}" for v in per_round))
    if "no-adapter" in baselines:
        # The tax again, both engines stepped in turn in one process (drift hits both alike).
        pairs = []
        for r in range(a.repeats):
            log("offline: lorafleet and (a) stepped in turn" + (f" (round {r + 1}/{a.repeats})" if a.repeats > 1 else ""))
            order = [False, True] if r % 2 == 0 else [True, False]  # who steps first alternates by round
            pairs.append(stepped_in_turn({("no-adapter" if bare else "lorafleet"): (engine_config(setup, model_dir), *workload_jobs(off, adapters, bare))
                                          for bare in order}))
        ratios["lorafleet / no-adapter, stepped in turn"] = in_turn_ratio(pairs, "lorafleet", "no-adapter")
        results["stepped_in_turn"] = pairs
    for k, v in ratios.items():
        print(f"{k:<45} " + (f"{v:6.2f}x" if v is not None else "     - (the baseline produced no tokens)"))

    # 2. Online replay at the workload's arrival rate.
    span = f", arrivals over {duration_text(workload.arrival_span_s)}" if long_replay else ""
    log(("online: replay, every request at once" if spec.rate <= 0 else f"online: replay at {spec.rate:g} req/s{span}") + (f" over HTTP to {a.url}" if a.url else " over HTTP to a spawned server" if a.spawn_server else " in-process"))
    if a.url:
        online = asyncio.run(replay_http(a.url, a.base_model or base_model_of(cards), workload.requests, "lorafleet online (http)", a.api_key))
    elif a.spawn_server:
        log(f"starting lorafleet serve --device {a.device} (log: {out / 'server.log'})")
        try:
            with spawned_server(setup, model_dir, adapters, out / "server.log") as url:
                base = served_base_model(url)
                log(f"warm-up over HTTP: {'the first 4 requests' if on_cpu else 'the whole workload'}, all at once, untimed")
                asyncio.run(replay_http(url, base, warm, "warm-up (http)"))
                online = asyncio.run(replay_http(url, base, workload.requests, "lorafleet online (http)"))
        except ServerStartError as err:
            print(f"serve.py: --spawn-server: {err}", file=sys.stderr)
            return 1
    else:
        online = run_lorafleet(workload, setup, model_dir, adapters, "lorafleet online")
    on = summarized(online)
    ttfts = ttft_by_adapter(online.records)
    on["fairness"] = fairness = adapter_fairness(ttfts)
    results["online"] = on
    print(table([on]))
    if fairness and fairness["ratio"] is not None:  # None: the most popular adapter's p99 TTFT was 0
        print(f"fairness: p99 TTFT least popular / most popular = {fairness['ratio']:.2f}")
    plots.per_adapter_ttft(ttfts, staged("per_adapter_ttft.png"))

    # 3. Sweeps.
    if counts:
        prepared = {}
        for n in counts:
            w = generate(dataclasses.replace(spec, num_adapters=n, popularity="zipf", num_requests=a.sweep_requests or spec.num_requests)).all_at_once()
            prepared[n] = (w, *prepare(w, setup))
        sweep_rounds: list[dict[int, dict]] = []
        for r in range(a.repeats):
            sweep_rounds.append({})
            for n in counts:
                log(f"sweep: {n} adapters (zipf alpha {spec.alpha}), offline" + (f" (round {r + 1}/{a.repeats})" if a.repeats > 1 else ""))
                w, m, ads = prepared[n]
                sweep_rounds[-1][n] = summarized(run_lorafleet(w, setup, m, ads, f"{n} adapters"), r + 1)
        points = []
        for n in counts:
            s = median_round([rd[n] for rd in sweep_rounds], "throughput_tokens_per_s")
            bound = slot_bound(((q.adapter, q.output_tokens) for q in prepared[n][0].requests), setup.max_loras, setup.max_num_seqs)
            points.append((n, s["throughput_tokens_per_s"], s["adapter_swaps"], s["engine_steps"], bound))
        # The no-adapter line: run (a)'s throughput, drawn only where the sweep ran the very same requests
        # (prompts and output lengths; a sweep's workload differs from the main one in its adapters only
        # unless --sweep-requests or --workload made it another set).
        base_tp = by_label.get("(a) no adapters", {}).get("throughput_tokens_per_s")
        same_requests = all([(q.prompt, q.output_tokens) for q in prepared[n][0].requests] == [(q.prompt, q.output_tokens) for q in off.requests]
                            for n in counts)  # fmt: skip
        if base_tp is not None and not same_requests:
            log("sweep: the no-adapter line is left out of throughput_vs_adapters.png: run (a) replayed other requests than the sweep")
            base_tp = None
        results["sweep_no_adapter_tokens_per_s"] = base_tp
        plots.throughput_vs_adapters([(n, t) for n, t, *_ in points], base_tp, staged("throughput_vs_adapters.png"))
        results["sweep_adapters"] = [{"adapters": n, "requests": len(prepared[n][0].requests), "tokens_per_s": t, "swaps": s, "steps": st,
                                      "slot_bound": b.as_dict()} for n, t, s, st, b in points]
        results["sweep_rounds_tokens_per_s"] = {str(n): [rd[n]["throughput_tokens_per_s"] for rd in sweep_rounds] for n in counts}
        if len(counts) > 1:  # the largest count against the smallest, per round
            lo, hi = min(counts), max(counts)
            in_turn = []
            for r in range(a.repeats):
                log(f"sweep: {hi} and {lo} adapters stepped in turn" + (f" (round {r + 1}/{a.repeats})" if a.repeats > 1 else ""))
                order = [hi, lo] if r % 2 == 0 else [lo, hi]
                in_turn.append(stepped_in_turn({str(n): (engine_config(setup, prepared[n][1]), *workload_jobs(prepared[n][0], prepared[n][2])) for n in order}))
            results["sweep_ratio_most_vs_fewest_adapters"] = {
                "adapters": [lo, hi],
                "ratio": ratio(hi, lo, sweep_rounds),
                "ratio_stepped_in_turn": in_turn_ratio(in_turn, str(hi), str(lo)),
                "stepped_in_turn": in_turn,
            }
        for n, t, s, st, b in points:
            print(f"{n:>5} adapters: {t:8.1f} tok/s, {s} swaps, {st} steps ({b.adapters} distinct adapters need "
                  f"{b.slot_steps} slot-steps: at least {b.lower_bound} steps; best packing of whole slot runs "
                  f"{b.packed}{'' if b.packed_exact else ' (longest first; search gave up)'})")
        if "sweep_ratio_most_vs_fewest_adapters" in results:
            sr = results["sweep_ratio_most_vs_fewest_adapters"]
            if sr["ratio"] is not None:
                print(f"{sr['adapters'][1]} / {sr['adapters'][0]} adapters (median of rounds): {sr['ratio']:.2f}x")
            if sr["ratio_stepped_in_turn"] is not None:
                print(f"{sr['adapters'][1]} / {sr['adapters'][0]} adapters, stepped in turn (median of rounds): {sr['ratio_stepped_in_turn']:.2f}x")
    if rates:
        rpoints = []
        for rate in rates:
            w = generate(dataclasses.replace(spec, rate=rate))
            _, rate_adapters = prepare(w, setup)  # its requests may use adapters the main workload does not (a --workload file)
            log(f"sweep: rate {rate}/s, online")
            s = summarized(run_lorafleet(w, setup, model_dir, rate_adapters, f"rate {rate}"))
            rpoints.append((rate, s["ttft_p99_s"], s["tpot_p99_s"]))  # None: not measured (every request failed; one-token outputs)
        plots.p99_vs_rate(rpoints, staged("p99_vs_rate.png"))
        results["sweep_rates"] = [{"rate": r, "ttft_p99_s": t, "tpot_p99_s": q} for r, t, q in rpoints]
        for r, t, q in rpoints:
            print(f"rate {r:g}/s: p99 TTFT {'-' if t is None else f'{t:.3f}'} s, p99 TPOT {'-' if q is None else f'{q:.3f}'} s")
    staged("summary.json").write_text(json.dumps(results, indent=2, default=str))
    for name in OUTPUTS:  # the run is complete: its files replace the last run's, and a file it did not write goes
        (out / name).unlink(missing_ok=True)
        if staged(name).exists():
            staged(name).replace(out / name)
    log(f"wrote {out / 'summary.json'}, records.jsonl, workload.jsonl and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
