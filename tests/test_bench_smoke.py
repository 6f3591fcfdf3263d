"""CI smoke test of the serving benchmark: schema and internal consistency, never timings."""
from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from runtime.bench.summary import BASE, median, percentile
from runtime.bench.workload import Workload, WorkloadSpec, generate

ROOT = Path(__file__).resolve().parents[1]


def test_workload_roundtrip_and_popularity(tmp_path: Path) -> None:
    spec = WorkloadSpec(num_requests=200, num_adapters=10, popularity="zipf", alpha=1.0, rate=5.0, cv=2.0, seed=3)
    w = generate(spec)
    w.save(tmp_path / "w.jsonl")
    back = Workload.load(tmp_path / "w.jsonl")
    assert back == w  # every system sees exactly the same requests
    counts = {}
    for r in w.requests:
        counts[r.adapter] = counts.get(r.adapter, 0) + 1
    assert counts["lora-0000"] > counts.get("lora-0009", 0)  # zipf: adapter 0 is the most popular
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert generate(spec) == w  # seeded
    distinct = generate(WorkloadSpec(num_requests=20, num_adapters=20, popularity="distinct"))
    assert len({r.adapter for r in distinct.requests}) == 20
    assert {r.adapter for r in generate(WorkloadSpec(num_requests=20, popularity="identical")).requests} == {"lora-0000"}


def test_percentile_is_ordered_and_interpolates() -> None:
    vals = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(vals, 0) == 1.0 and percentile(vals, 100) == 5.0 and percentile(vals, 50) == 3.0
    assert percentile(vals, 25) == 2.0 and percentile([], 50) is None


def test_adapter_count_changes_only_the_adapters() -> None:
    """The 16 -> 500 adapter sweep must compare the same requests: arrivals, base rows, prompts
    and output lengths do not depend on the adapter set."""
    spec = WorkloadSpec(num_requests=40, num_adapters=16, popularity="zipf", rate=3.0, base_fraction=0.2, seed=5)
    few, many = generate(spec), generate(WorkloadSpec(**{**spec.__dict__, "num_adapters": 500, "ranks": (8, 16)}))
    same = lambda w: [(r.arrival_s, r.adapter is None, r.prompt, r.output_tokens) for r in w.requests]  # noqa: E731
    assert same(few) == same(many)
    assert {r.adapter for r in few.requests} != {r.adapter for r in many.requests}  # the adapters do change


def _pct(values: list[float], q: float) -> float | None:
    """numpy's linear-interpolation percentile: an independent check of summary.percentile."""
    return float(numpy.percentile(values, q)) if values else None


def _check_latency_block(block: dict, records: list[dict]) -> None:
    """A summary's request count and TTFT/TPOT p50/p99, recomputed from its raw records."""
    assert block["requests_ok"] == len(records)
    for key in ("ttft", "tpot"):
        values = [r[key] for r in records if r[key] is not None]
        for q in (50, 99):
            want = _pct(values, q)
            assert block[f"{key}_p{q}_s"] == (None if want is None else pytest.approx(want, rel=1e-9, abs=1e-12)), (key, q)


def test_serve_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--out", str(out), "--num-requests", "8", "--adapters", "3",
           "--hidden", "64", "--layers", "1", "--input-len", "2,4", "--output-len", "2,5", "--rate", "20", "--loop-requests", "3",
           "--baselines", "no-adapter,loop,peft", "--sweep-adapters", "2,3", "--sweep-requests", "12", "--sweep-rates", "20", "--repeats", "2"]
    done = subprocess.run(cmd, check=True, cwd=ROOT, timeout=600, capture_output=True, text=True)
    # On the CPU (no kernel JIT) the untimed warm-up is four requests; off it, the whole workload.
    assert "warm-up: one untimed lorafleet run on the first 4 requests" in done.stdout + done.stderr
    res = json.loads((out / "summary.json").read_text())
    workload = Workload.load(out / "workload.jsonl")
    want_out = {r.index: r.output_tokens for r in workload.requests}
    want_tokens = sum(want_out.values())
    loop_subset = [r.index for r in workload.requests[:3]]  # --loop-requests 3: the first 3 requests
    runs: dict[tuple[str, int | None], list[dict]] = {}  # (label, round) -> that run's records
    for line in (out / "records.jsonl").read_text().splitlines():
        rec = json.loads(line)
        runs.setdefault((rec["label"], rec["round"]), []).append(rec)
    peft = "(c) transformers+peft"

    # The adapter sweep's runs replay --sweep-requests requests of the same spec (zipf over 2 or 3 adapters).
    sweep_out = {f"{n} adapters": {r.index: (r.adapter, r.output_tokens) for r in
                                   generate(dataclasses.replace(workload.spec, num_requests=12, num_adapters=n, popularity="zipf")).requests}
                 for n in (2, 3)}

    # Every request of every run, on its own: timings in a possible order, exactly its output length.
    for (label, _), recs in runs.items():
        for r in recs:
            if label in sweep_out:
                assert r["error"] is None and (r["adapter"], r["output_tokens"]) == sweep_out[label][r["index"]], (label, r)
            else:
                assert r["error"] is None and r["output_tokens"] == want_out[r["index"]], (label, r)
            if label == peft:  # batch latency only; no streamed timings, no engine
                assert r["ttft"] is None and r["engine_ttft"] is None and r["latency"] > 0
                continue
            assert 0 <= r["ttft"] <= r["latency"], (label, r)
            assert r["tpot"] is None or 0 <= r["tpot"] <= r["latency"], (label, r)
            # The engine stamps its arrival after the client's and its first token before the client reads it
            # (time.monotonic and time.perf_counter: the same clock on Linux).
            assert r["engine_ttft"] is not None and 0 < r["engine_ttft"] <= r["ttft"] + 1e-6, (label, r)

    # Each offline row is its median round's summary: recompute it from that round's records.
    offline = {r["label"]: r for r in res["offline"]}
    for label, row in offline.items():
        per_round = res["offline_rounds_tokens_per_s"][label]
        assert len(per_round) == 2 and row["throughput_tokens_per_s"] == max(per_round)  # of two rounds, the upper middle one
        recs = runs[(label, per_round.index(row["throughput_tokens_per_s"]) + 1)]
        assert row["requests_failed"] == 0 and row["requests_ok"] == len(recs)
        assert row["output_tokens"] == sum(r["output_tokens"] for r in recs)
        assert row["throughput_tokens_per_s"] == pytest.approx(row["output_tokens"] / row["wall_s"])
        _check_latency_block(row, recs)
    for label in ("lorafleet offline", "(a) no adapters", peft):
        assert offline[label]["requests_ok"] == 8 and offline[label]["output_tokens"] == want_tokens
    for label in ("(b) per-request loop", "lorafleet on loop subset"):  # both run the same first 3 requests
        assert offline[label]["requests_ok"] == 3 and offline[label]["output_tokens"] == sum(want_out[i] for i in loop_subset)
        for rnd in (1, 2):
            assert sorted(r["index"] for r in runs[(label, rnd)]) == loop_subset, (label, rnd)
    for label in offline:
        for rnd in (1, 2):
            assert len(runs[(label, rnd)]) == (3 if "loop" in label else 8), (label, rnd)

    online = res["online"]
    on_recs = runs[("lorafleet online", None)]
    assert online["requests_ok"] == 8 and online["output_tokens"] == want_tokens == sum(r["output_tokens"] for r in on_recs)
    assert online["throughput_tokens_per_s"] == pytest.approx(online["output_tokens"] / online["wall_s"])
    _check_latency_block(online, on_recs)
    for name, block in online["per_adapter"].items():
        _check_latency_block(block, [r for r in on_recs if (r["adapter"] or BASE) == name])
    assert sum(v["requests_ok"] for v in online["per_adapter"].values()) == 8
    for loc, block in online["ttft_by_adapter_location"].items():
        _check_latency_block(block, [r for r in on_recs if r["adapter_location"] == loc])
    # Fairness: p99 TTFT of the least popular adapters (by successful requests with a TTFT; the
    # worst of them) over the best of the most popular ones', base-model requests left out.
    ttfts: dict[str, list[float]] = {}
    for r in on_recs:
        if r["ttft"] is not None and r["adapter"] is not None and r["error"] is None:
            ttfts.setdefault(r["adapter"], []).append(r["ttft"])
    counts = {name: len(v) for name, v in ttfts.items()}
    assert len(counts) >= 2  # otherwise serve.py reports no fairness
    fairness = online["fairness"]
    assert sorted(fairness["most_popular"]) == sorted(n for n, k in counts.items() if k == max(counts.values()))
    assert sorted(fairness["least_popular"]) == sorted(n for n, k in counts.items() if k == min(counts.values()))
    most = min(_pct(ttfts[n], 99) for n in fairness["most_popular"])
    least = max(_pct(ttfts[n], 99) for n in fairness["least_popular"])
    assert fairness["most_popular_p99_ttft_s"] == pytest.approx(most, rel=1e-9)
    assert fairness["least_popular_p99_ttft_s"] == pytest.approx(least, rel=1e-9)
    assert fairness["ratio"] == pytest.approx(least / most, rel=1e-9)
    cache = online["cache"]
    with_adapter = sum(1 for r in workload.requests if r.adapter)
    distinct_adapters = len({r.adapter for r in workload.requests if r.adapter})  # distinct adapters the workload uses
    assert cache["device_hits"] + cache["host_hits"] + cache["disk_misses"] == with_adapter
    assert sum(b["requests_ok"] for b in online["ttft_by_adapter_location"].values()) == with_adapter
    assert all(online["memory"][k] > 0 for k in ("weights_bytes", "kv_cache_bytes", "lora_pool_bytes", "workspace_bytes"))
    assert [p["rate"] for p in res["sweep_rates"]] == [20.0]
    rate_recs = runs[("rate 20.0", None)]
    assert res["sweep_rates"][0]["ttft_p99_s"] == pytest.approx(_pct([r["ttft"] for r in rate_recs], 99), rel=1e-9)
    assert offline[peft]["adapter_swaps"] is None  # not measured there, so not reported as 0
    assert res["peft_batch"] == 32  # defaults to the engine's batch cap (--max-num-seqs)

    def ratio(num: str, den: str, per_round: dict[str, list[float]]) -> float:
        """As serve.py's ``ratio``: the upper median of the within-round throughput quotients."""
        return median([n / d for n, d in zip(per_round[num], per_round[den])])

    # Stepped in turn: every request of both runs each round, who steps first alternating; the
    # LoRA run puts each of the workload's adapters on the device once (3 <= --max-loras 8), the other none.
    pairs = res["stepped_in_turn"]
    assert [list(pr) for pr in pairs] == [["lorafleet", "no-adapter"], ["no-adapter", "lorafleet"]]
    for pr in pairs:
        for name, run in pr.items():
            assert run["tokens"] == want_tokens and run["steps"] > 0
            assert run["tokens_per_s"] == pytest.approx(run["tokens"] / run["busy_s"], rel=1e-3, abs=0.05)  # rounded to 0.1
            loaded = distinct_adapters if name == "lorafleet" else 0
            assert run["adapters_loaded"] == run["device_loads"] == loaded and run["host_loads"] >= loaded, (name, run)
    offline_rounds = res["offline_rounds_tokens_per_s"]
    assert res["ratios"] == {
        "lorafleet / no-adapter": ratio("lorafleet offline", "(a) no adapters", offline_rounds),
        "lorafleet / per-request loop (same subset)": ratio("lorafleet on loop subset", "(b) per-request loop", offline_rounds),
        "lorafleet / transformers+peft": ratio("lorafleet offline", peft, offline_rounds),
        "lorafleet / no-adapter, stepped in turn": median([pr["lorafleet"]["tokens_per_s"] / pr["no-adapter"]["tokens_per_s"] for pr in pairs]),
    }
    assert all(v > 0 for v in res["ratios"].values())
    assert [p["adapters"] for p in res["sweep_adapters"]] == [2, 3]
    assert res["setup"]["max_num_batched_tokens"] == str(max(256, int(res["setup"]["max_num_seqs"])))  # the cpu default, spelt out
    assert res["machine"]["cores"] >= 1 and res["machine"]["cpu"] and res["machine"]["python"]
    for p in res["sweep_adapters"]:  # steps of the median round, against what any schedule needs for those requests
        recs = runs[(f"{p['adapters']} adapters", 1)]
        loras, seqs = int(res["setup"]["max_loras"]), int(res["setup"]["max_num_seqs"])
        longest: dict[str, int] = {}  # the bound worked out here from the records, not by slot_bound
        for r in recs:
            if r["adapter"] is not None:
                longest[r["adapter"]] = max(longest.get(r["adapter"], 0), r["output_tokens"])
        outs = [r["output_tokens"] for r in recs]
        lower = max(-(-sum(longest.values()) // loras), -(-sum(outs) // seqs), max(outs))
        bound = p["slot_bound"]
        assert (bound["adapters"], bound["slot_steps"], bound["lower_bound_steps"]) == (len(longest), sum(longest.values()), lower)
        assert lower <= bound["packed_steps"] and bound["packed_exact"]
        assert p["steps"] >= lower > 0
    assert offline["(a) no adapters"]["engine_steps"] >= max(want_out.values()) and offline[peft]["engine_steps"] is None
    assert all(len(runs[(f"{n} adapters", rnd)]) == 12 for n in (2, 3) for rnd in (1, 2))  # --sweep-requests, not --num-requests
    assert [p["requests"] for p in res["sweep_adapters"]] == [12, 12]
    # (a) ran the 8 requests of the main workload, the sweep 12 others: no "no adapters" line under the sweep's points.
    assert res["sweep_no_adapter_tokens_per_s"] is None and "the no-adapter line is left out" in done.stdout + done.stderr
    sweep_rounds = res["sweep_rounds_tokens_per_s"]
    assert list(sweep_rounds) == ["2", "3"] and all(len(v) == 2 for v in sweep_rounds.values())
    for p in res["sweep_adapters"]:  # each point is its median round
        assert p["tokens_per_s"] == max(sweep_rounds[str(p["adapters"])])  # the upper middle of two rounds
    sweep_ratio = res["sweep_ratio_most_vs_fewest_adapters"]
    assert sweep_ratio["adapters"] == [2, 3] and sweep_ratio["ratio"] == ratio("3", "2", sweep_rounds) > 0
    assert [list(pr) for pr in sweep_ratio["stepped_in_turn"]] == [["3", "2"], ["2", "3"]]
    for pr in sweep_ratio["stepped_in_turn"]:
        for n, run in pr.items():
            recs = runs[(f"{n} adapters", 1)]
            assert run["tokens"] == sum(r["output_tokens"] for r in recs)
            used = len({r["adapter"] for r in recs if r["adapter"] is not None})
            assert run["adapters_loaded"] == run["device_loads"] == used > 0 and run["host_loads"] >= used, (n, run)
    assert sweep_ratio["ratio_stepped_in_turn"] == median([pr["3"]["tokens_per_s"] / pr["2"]["tokens_per_s"] for pr in sweep_ratio["stepped_in_turn"]])
    # records.jsonl holds exactly the summarized runs: 5 offline configs and 2 adapter counts x 2 rounds, online, one rate
    assert len(runs) == 5 * 2 + 2 * 2 + 2
    for png in ("per_adapter_ttft.png", "throughput_vs_adapters.png", "p99_vs_rate.png"):
        assert (out / png).stat().st_size > 1000


def test_engine_throughput_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/engine_throughput.py on a 1-layer hidden-64 model: every run generates every
    token, the rounds and ratios are all there, and the mixed-rank pool costs less than padding."""
    out = tmp_path / "engine.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "engine_throughput.py"), "--hidden", "64", "--layers", "1", "--requests", "6",
           "--max-tokens", "3", "--prompt-len", "4", "--rounds", "2", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=600, capture_output=True)
    res = json.loads(out.read_text())
    assert res["model"]["hidden_size"] == 64 and res["model"]["num_hidden_layers"] == 1  # --hidden/--layers are honoured
    runs = ["base_only", "mixed_8_rank16_uniform", "zipf_8_adapters", "zipf_200_adapters", "zipf_200_adapters_max_loras_8"]
    for name in runs:
        r = res[name]
        assert r["tokens"] == 6 * 3, name
        assert len(r["tokens_per_s_rounds"]) == 2 and r["tokens_per_s"] == max(r["tokens_per_s_rounds"])  # the median round (upper of two)
        # tokens_per_s = tokens / wall time, reported rounded (wall_s to 1 ms, tokens_per_s to 0.1)
        assert r["tokens"] / (r["wall_s"] + 5e-4) - 0.05 <= r["tokens_per_s"] <= r["tokens"] / max(r["wall_s"] - 5e-4, 1e-9) + 0.05, name
    assert res["zipf_200_adapters_max_loras_8"]["pool"]["device_slots_total"] == 8
    assert res["mixed_8_rank16_uniform"]["pool"]["device_slots_used"] == 6  # 6 requests round-robin over a0..a7
    # every adapter the zipf picks used was loaded once and, with 32 slots, is still resident at the end
    assert res["zipf_200_adapters"]["pool"]["device_slots_used"] == res["zipf_200_distinct_adapters_used"]
    pool = res["mixed_rank_pool"]
    assert pool["device_rows_used"] == 2 * (8 + 16 + 32 + 64)
    assert pool["device_bytes_in_use"] < pool["device_bytes_if_padded"]

    def ratio(num: str, den: str) -> float:
        """As engine_throughput.py computes it: the median of the within-round quotients, to 3 places."""
        return round(median([n / d for n, d in zip(res[num]["tokens_per_s_rounds"], res[den]["tokens_per_s_rounds"])]), 3)

    assert res["ratio_multi_lora_vs_base"] == ratio("mixed_8_rank16_uniform", "base_only") > 0
    assert res["ratio_200_vs_8_zipf"] == ratio("zipf_200_adapters", "zipf_8_adapters") > 0
    assert res["ratio_200_max_loras_8_vs_8_zipf"] == ratio("zipf_200_adapters_max_loras_8", "zipf_8_adapters") > 0
    # Adapters each alternating run put on the device (32 slots: each adapter used, once)
    used = {"base_only": 0, "mixed_8_rank16_uniform": 6, "zipf_200_adapters": res["zipf_200_distinct_adapters_used"],
            "zipf_8_adapters": res["zipf_8_distinct_adapters_used"]}  # fmt: skip
    assert 0 < used["zipf_8_adapters"] <= 8
    # The alternating-steps pairs: both engines finish every request, and each ratio is the median round's.
    for key, (num, den) in {"multi_lora_vs_base": ("mixed_8_rank16_uniform", "base_only"),
                            "200_vs_8_zipf": ("zipf_200_adapters", "zipf_8_adapters")}.items():  # fmt: skip
        paired = res["alternating_steps"][key]
        assert len(paired) == 2 and all(set(r) == {num, den} for r in paired)
        for r in (run for rnd in paired for run in rnd.values()):
            assert r["tokens"] == 6 * 3 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["busy_s"], rel=1e-3, abs=0.1)
        for name, r in ((name, r) for rnd in paired for name, r in rnd.items()):
            want = used[name]
            assert r["adapters_loaded"] == r["device_loads"] == want and (want > 0) == (name != "base_only"), (key, name, r)
            assert (r["host_loads"] >= want) and (r["host_loads"] > 0) == (name != "base_only"), (key, name, r)  # registering loads too
        ratios = [r[num]["tokens_per_s"] / r[den]["tokens_per_s"] for r in paired]
        assert res[f"ratio_{key}_alternating"] == round(sum(ratios) / 2, 3)  # the median of two


def test_serve_benchmark_replays_a_saved_workload(tmp_path: Path) -> None:
    saved = tmp_path / "w.jsonl"
    generate(WorkloadSpec(num_requests=4, num_adapters=2, ranks=(8,), input_len=(2, 3), output_len=(2, 3), rate=0, seed=9)).save(saved)
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--out", str(out), "--workload", str(saved), "--hidden", "64",
           "--layers", "1", "--baselines", "none", "--sweep-adapters", "", "--sweep-rates", ""]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=600, capture_output=True)
    assert Workload.load(out / "workload.jsonl") == Workload.load(saved)  # the very same requests, not a regenerated set
    assert json.loads((out / "summary.json").read_text())["online"]["requests_ok"] == 4


def test_serve_benchmark_over_http_to_a_server_it_spawns(tmp_path: Path) -> None:
    """--spawn-server: the online replay streams over HTTP from a `lorafleet serve` started with the
    run's model and adapters; every request comes back whole, and the server is stopped afterwards."""
    saved = tmp_path / "w.jsonl"
    generate(WorkloadSpec(num_requests=6, num_adapters=3, ranks=(8, 16), input_len=(2, 4), output_len=(2, 5), rate=30, base_fraction=0.3,
                          seed=4)).save(saved)  # fmt: skip
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--out", str(out), "--workload", str(saved), "--hidden", "64",
           "--layers", "1", "--baselines", "none", "--sweep-adapters", "", "--sweep-rates", "", "--spawn-server"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    workload = Workload.load(saved)
    assert {r.adapter for r in workload.requests} > {None}  # adapter rows and base rows
    online = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    online = [r for r in online if r["label"] == "lorafleet online (http)"]
    assert sorted(r["index"] for r in online) == [r.index for r in workload.requests]
    want = {r.index: (r.adapter, r.output_tokens) for r in workload.requests}
    for r in online:
        assert r["error"] is None and (r["adapter"], r["output_tokens"]) == want[r["index"]], r
        assert r["engine_ttft"] is None and 0 < r["ttft"] <= r["latency"], r  # timed by the client, over the wire
    assert json.loads((out / "summary.json").read_text())["online"]["requests_ok"] == 6
    assert "HTTP server and engine stopped" in (out / "server.log").read_text()


def _serve_on_workload(saved: Path, out: Path, sweep_rates: str) -> tuple[subprocess.CompletedProcess, dict]:
    """benchmarks/serve.py on a saved workload, tiny model, no baselines or adapter sweep; (process, summary.json)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--out", str(out), "--workload", str(saved), "--hidden", "64",
           "--layers", "1", "--baselines", "none", "--sweep-adapters", "", "--sweep-rates", sweep_rates]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads((out / "summary.json").read_text())


def test_a_spawned_server_that_cannot_start_is_an_error_with_its_log(tmp_path: Path) -> None:
    from runtime.bench.server_process import ServerStartError, spawned_server
    from runtime.bench.suite import BenchSetup

    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError, match="exited with status") as err:
        with spawned_server(BenchSetup(tmp_path), tmp_path / "no-model", {}, log, start_timeout_s=120):
            raise AssertionError("never ready")
    assert str(tmp_path / "no-model") in str(err.value)  # the server's own message, quoted from its log


def test_rate_sweep_of_a_saved_workload_builds_the_adapters_its_own_requests_use(tmp_path: Path) -> None:
    """A saved file whose requests use other adapters than its spec generates: the rate sweep
    regenerates from the spec, so it must build the adapters those requests use too. One-token
    outputs have no TPOT: the sweep reports None (it reported 0.0, a perfect latency)."""
    spec = WorkloadSpec(num_requests=4, num_adapters=4, ranks=(8,), input_len=(2, 3), output_len=(1, 1), rate=0, seed=9)
    generated = generate(spec)
    used = {r.adapter for r in generated.requests}
    unused = sorted(set(generated.adapter_ranks) - used)
    assert unused and None not in used
    others = tuple(dataclasses.replace(r, adapter=unused[i % len(unused)]) for i, r in enumerate(generated.requests))
    saved = tmp_path / "w.jsonl"
    dataclasses.replace(generated, requests=others).save(saved)
    out = tmp_path / "bench"
    proc, res = _serve_on_workload(saved, out, "50")
    assert res["online"]["requests_ok"] == 4 and [p["rate"] for p in res["sweep_rates"]] == [50.0]
    assert res["sweep_rates"][0]["tpot_p99_s"] is None and res["sweep_rates"][0]["ttft_p99_s"] > 0
    assert "rate 50/s: p99 TTFT " in proc.stdout and "p99 TPOT - s" in proc.stdout and (out / "p99_vs_rate.png").exists()


def test_host_tier_below_device_slots_is_an_error_not_raised_silently(tmp_path: Path) -> None:
    from runtime.bench.suite import host_tier_size

    assert host_tier_size(8, None) == 32 and host_tier_size(64, None) == 64 and host_tier_size(8, 8) == 8
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--out", str(tmp_path / "never"), "--max-loras", "8", "--max-cpu-loras", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 2 and "--max-cpu-loras 4 is below --max-loras 8" in proc.stderr
    assert not (tmp_path / "never").exists()  # refused before anything is written
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", "--max-loras", "8", "--max-cpu-loras", "4", "--workdir", str(tmp_path / "w")],
                          cwd=ROOT, timeout=120, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "--max-cpu-loras 4 is below --max-loras 8" in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--baselines", "pef,lop"], "--baselines: 'pef', 'lop' is not one of no-adapter, loop, peft"),
    (["--baselines", "none", "--base-model", "x"], "--base-model: only used with --url"),
    (["--baselines", "no-adapter", "--loop-requests", "3"], "--loop-requests: only used with the loop baseline"),
    (["--baselines", "loop", "--peft-batch", "3"], "--peft-batch: only used with the peft baseline"),
    (["--sweep-adapters", "", "--sweep-requests", "3"], "--sweep-requests: only used with --sweep-adapters"),
    (["--spawn-server", "--url", "http://127.0.0.1:9"], "--spawn-server and --url"),
    (["--spawn-server", "--max-num-batched-tokens", "16"], "lorafleet serve refuses --max-num-batched-tokens 16 below --max-num-seqs 32"),
    (["--api-key", "k"], "--api-key: only used with --url"),
    (["--url", "http://127.0.0.1:9", "--sweep-rates", "1,2"], "--sweep-rates: the arrival-rate sweep runs in-process only, not with --url"),
])
def test_serve_benchmark_refuses_flags_its_runs_would_ignore(tmp_path: Path, flags: list[str], message: str) -> None:
    """A misspelt baseline ran no comparison and exited 0; flags the chosen runs never read were dropped."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--out", str(tmp_path / "never"), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("flags, message", [
    (["--sweep-adapters", "16,x"], "--sweep-adapters: expected comma-separated adapter counts like 16,100,500, got '16,x'"),
    (["--sweep-adapters", "0"], "--sweep-adapters 0: adapters: must be >= 1, got 0"),
    (["--sweep-rates", "1,x"], "--sweep-rates: expected comma-separated arrival rates like 1,2,4, got '1,x'"),
    (["--sweep-rates", "inf"], "--sweep-rates: inf is not a finite rate >= 0"),
    (["--num-requests", "0"], "--num-requests: must be >= 1, got 0"),
    (["--input-len", "9,3"], "--input-len: need 1 <= lo <= hi"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--max-loras", "0"], "--max-loras must be >= 1, got 0"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1, got 0"),
    (["--slo-ttft", "-1"], "--slo-ttft: must be a positive number of seconds, got -1.0"),
    (["--workload", "w.jsonl", "--num-requests", "5"], "--num-requests: not used with --workload"),
    (["--workdir", "/dev/null/w"], "--workdir /dev/null/w: cannot be created: /dev/null is a file"),
])
def test_serve_benchmark_refuses_bad_values_before_any_run(tmp_path: Path, flags: list[str], message: str) -> None:
    """Bad values were tracebacks, some only after every main run (the sweep lists); each is now
    one line and exit 2, before --out is made."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--out", str(tmp_path / "never"), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "never").exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--out", str(a_file)], cwd=ROOT, timeout=120,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and f"--out {a_file}: is a file, not a folder" in proc.stderr and a_file.read_text() == "mine"


def test_serve_benchmark_replaces_a_previous_run_only_when_it_completes(tmp_path: Path, interactive_sigint: None) -> None:
    """A run stopped midway (SIGINT here) leaves the previous run's files as they were; a complete
    one replaces them all, a plot it did not draw included, and leaves no staged file behind."""
    out = tmp_path / "bench"
    out.mkdir()
    previous = {"summary.json": '{"previous": true}', "records.jsonl": "previous\n", "workload.jsonl": "previous\n",
                "p99_vs_rate.png": "previous"}  # fmt: skip
    for name, text in previous.items():
        (out / name).write_text(text)
    base = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--out", str(out), "--hidden", "64", "--layers", "1",
            "--baselines", "none", "--sweep-adapters", "", "--sweep-rates", ""]  # fmt: skip
    slow = base + ["--num-requests", "48", "--output-len", "64,96", "--rate", "0"]
    proc = subprocess.Popen(slow, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if "offline: lorafleet" in line:  # past the staging, inside the first timed run
                proc.send_signal(signal.SIGINT)
                break
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert {name: (out / name).read_text() for name in previous} == previous
    assert (out / ".partial-workload.jsonl").is_file()  # the stopped run's own, beside them
    done = subprocess.run(base + ["--num-requests", "4", "--output-len", "2,3"], cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["online"]["requests_ok"] == 4
    assert not (out / "p99_vs_rate.png").exists()  # no rate sweep this time: the old plot is not left as if it were this run's
    assert Workload.load(out / "workload.jsonl").spec.num_requests == 4
    assert not list(out.glob(".partial-*"))


def test_decode_attention_benchmark_smoke(tmp_path: Path) -> None:
    """Both variants run on every context range and match a float64 dense reference (the
    script checks, and reports the error), with a group budget small enough that the grouped
    variant runs several groups; the JSON has a positive time per variant, the ratio of the two
    and the number of groups the grouped call ran (read from its step plan)."""
    out = tmp_path / "attention.json"
    # 4 sequences x 2 heads x 8 dims x 4 bytes = 64 B per position; 8 KiB = 128 positions per group
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_attention.py"), "--batch", "4", "--heads", "2",
                           "--head-dim", "8", "--calls", "1", "--group-bytes", "8192", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["contexts"] for r in rows] == [[40, 60], [20, 100], [200, 300], [10, 612], [500, 612]]
    for r in rows:
        assert list(r["ms"]) == list(r["max_abs_err_vs_float64"]) == ["one group", "groups of 8192 B"]
        one, grouped = r["ms"].values()
        assert one > 0 and grouped > 0 and r["speedup"] == round(one / grouped, 2)
        assert all(0 <= err < 1e-5 for err in r["max_abs_err_vs_float64"].values())
    # 40-60 positions (48 or 64 in blocks of 16): two per group; 20-100: three groups;
    # from 200 positions on, every sequence alone
    assert [r["groups"] for r in rows] == [2, 3, 4, 4, 4]
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_attention.py"), "--group-bytes", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must be positive" in bad.stderr


def test_stepped_in_turn_with_more_adapters_than_the_host_tier(tmp_path: Path) -> None:
    """Three adapters through a host tier of two: the load that cannot start up front happens
    during the run (waiting for it before the first step would never end), and both runs
    produce every token, the LoRA run with every adapter loaded onto the device (one slot, so at
    least one device load each) and the base run loading none. In a subprocess, so a hang fails
    the test instead of stalling CI."""
    script = f"""
import json, sys
from pathlib import Path
sys.path.insert(0, {str(ROOT)!r})
from runtime.bench.suite import stepped_in_turn
from runtime.bench.synthetic import LlamaShape, build_random_adapter, build_random_llama
from runtime.config import EngineConfig
from runtime.request import SamplingParams
root = Path({str(tmp_path)!r})
shape = LlamaShape.sized(64, 1)
model = build_random_llama(root / "model", shape)
adapters = {{f"a{{i}}": build_random_adapter(root / f"a{{i}}", shape, 4, seed=i) for i in range(3)}}
config = EngineConfig(model=str(model), device="cpu", max_loras=1, max_cpu_loras=2, max_lora_rank=8, max_num_seqs=4)
params = SamplingParams(max_tokens=3, ignore_eos=True)
jobs = [("hello", name, params) for name in adapters] * 2
res = stepped_in_turn({{"lora": (config, adapters, jobs), "base": (config, {{}}, [(p, None, s) for p, _, s in jobs])}})
print(json.dumps(res))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(res) == ["lora", "base"]
    assert res["lora"]["tokens"] == res["base"]["tokens"] == 18
    lora, base = res["lora"], res["base"]
    assert lora["adapters_loaded"] == 3 and lora["device_loads"] >= 3
    assert lora["host_loads"] > 3  # one load per registration, and the adapter evicted by the third loaded again in the run
    assert base["adapters_loaded"] == base["host_loads"] == base["device_loads"] == 0


def test_step_times_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/step_times.py: both runs, two passes each, summaries consistent with themselves (no timings asserted)."""
    out = tmp_path / "steps.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_times.py"), "--hidden", "64", "--layers", "1", "--num-requests", "8",
           "--adapters", "3", "--input-len", "2,4", "--output-len", "3,6", "--max-num-batched-tokens", "4", "--workdir", str(tmp_path / "w"),
           "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, check=True, cwd=ROOT, timeout=600, capture_output=True, text=True)
    res = json.loads(out.read_text())
    assert res["workload"]["num_requests"] == 8 and res["shape"]["hidden_size"] == 64 and res["max_num_batched_tokens"] == 4
    spec = WorkloadSpec(num_requests=8, num_adapters=3, input_len=(2, 4), output_len=(3, 6))
    requests = generate(spec).requests
    # The 4-token budget reaches the engine: every prompt word is at least one token, and each request feeds
    # its prompt and all but its last token, at most 4 tokens a step (the engine's cpu default, 256, takes ~7 steps).
    fed = sum(r.input_words + r.output_tokens - 1 for r in requests)
    longest = max(max(r.output_tokens for r in requests), -(-fed // 4))
    for label in ("lora", "no_adapters"):
        assert len(res[label]) == 2, res[label]
        for n, p in enumerate(res[label]):
            assert p["steps"] >= longest, (p, longest)
            assert 0 < p["mean_ms"] and 0 < p["last60_mean_ms"] and len(p["slowest_ms"]) == min(5, p["steps"]), p
            assert p["slowest_ms"] == sorted(p["slowest_ms"], reverse=True) and p["slowest_ms"][0] >= p["mean_ms"] - 0.05, p  # rounding
            assert f"{label:12s} pass {n}: {p['steps']} steps" in done.stdout


@pytest.mark.parametrize("flags, message", [
    (["--rate", "3"], "--rate: every request runs at once here"),
    (["--input-len", "16"], "argument --input-len: expected two comma-separated integers"),
    (["--max-loras", "0"], "--max-loras: must be >= 1"),
    (["--json", "/nonexistent-folder/x.json"], "--json: the folder /nonexistent-folder does not exist"),
])  # fmt: skip
def test_step_times_refuses_bad_flags_before_writing_weights(tmp_path: Path, flags: list[str], message: str) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_times.py"), "--workdir", str(tmp_path / "w"), *flags]
    done = subprocess.run(cmd, cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "w").exists()


def test_serve_benchmark_sizes_the_slots_for_a_saved_workloads_own_ranks(tmp_path: Path) -> None:
    """A saved file whose adapters have a rank its spec's rank set lacks (above 64): the slots were
    sized from the spec's ranks only (max_lora_rank 64), so loading the adapters raised AdapterError,
    a traceback after the weights were written. `lorafleet bench --workload` sizes them from both."""
    spec = WorkloadSpec(num_requests=4, num_adapters=2, ranks=(8,), input_len=(2, 3), output_len=(2, 3), rate=0, seed=5)
    generated = generate(spec)
    ranks = {name: 96 + 8 * i for i, name in enumerate(sorted(generated.adapter_ranks))}
    edited = dataclasses.replace(generated, adapter_ranks=ranks,
                                 requests=tuple(dataclasses.replace(r, rank=ranks[r.adapter]) if r.adapter else r for r in generated.requests))
    saved = tmp_path / "w.jsonl"
    edited.save(saved)
    assert Workload.load(saved) == edited and any(r.adapter for r in edited.requests)
    _, res = _serve_on_workload(saved, tmp_path / "bench", "")
    assert res["online"]["requests_ok"] == 4 and res["online"]["requests_failed"] == 0
    assert int(res["setup"]["max_lora_rank"]) == max(ranks.values())


def test_workload_script_runs_this_checkouts_code_without_an_install(tmp_path: Path) -> None:
    """`python benchmarks/workload.py` (its documented use) put only benchmarks/ on sys.path: without an
    installed lorafleet it failed with ModuleNotFoundError: runtime, and with one installed from another
    checkout it ran that checkout's generator. -S leaves site-packages (and any install) out."""
    out = tmp_path / "w.jsonl"
    cmd = [sys.executable, "-S", str(ROOT / "benchmarks" / "workload.py"), "--out", str(out), "--num-requests", "7", "--adapters", "3",
           "--seed", "11", "--rate", "2.5"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Workload.load(out) == generate(WorkloadSpec(num_requests=7, num_adapters=3, seed=11, rate=2.5))


def test_fairness_compares_the_fewest_requested_adapters_with_the_most_and_leaves_the_base_out() -> None:
    """Random TTFTs for adapters of 5, 5, 2 and 2 requests and many base rows: the ratio is the worst
    p99 of the two-request adapters over the best p99 of the five-request ones (ties count against
    the engine), computed here with numpy's percentile."""
    import numpy as np

    from runtime.bench.summary import BASE, fairness

    rng = np.random.default_rng(7)
    ttfts = {name: list(rng.uniform(0.01, 0.5, size=k)) for name, k in (("a", 5), ("b", 5), ("c", 2), ("d", 2), (BASE, 40))}
    got = fairness(ttfts)
    assert got is not None and sorted(got["most_popular"]) == ["a", "b"] and sorted(got["least_popular"]) == ["c", "d"]
    most = min(np.percentile(ttfts[n], 99) for n in "ab")
    least = max(np.percentile(ttfts[n], 99) for n in "cd")
    assert got["most_popular_p99_ttft_s"] == pytest.approx(most, rel=1e-12) and got["least_popular_p99_ttft_s"] == pytest.approx(least, rel=1e-12)
    assert got["ratio"] == pytest.approx(least / most, rel=1e-12)
    assert fairness({"a": [0.1, 0.2], BASE: [0.3]}) is None  # one adapter: nothing to compare
    assert fairness({"a": [0.0], "b": [0.2]})["ratio"] is None  # the most popular's p99 is 0


def test_slo_attainment_counts_each_half_and_a_one_token_answer_meets_the_tpot_half() -> None:
    """Random TTFT/TPOT around the SLO lines: attainment is the share of successful requests under
    both; a one-token answer (no TPOT) is judged on TTFT alone; a failed request never attains."""
    import random

    from runtime.bench.replay import ReplayResult, RequestRecord
    from runtime.bench.summary import summarize

    rng = random.Random(5)
    records = [RequestRecord(i, "a", 0.0, 3, 4, ttft=rng.uniform(0.0, 2.0), tpot=rng.uniform(0.0, 0.2), latency=3.0) for i in range(40)]
    records += [RequestRecord(40 + i, "b", 0.0, 3, 1, ttft=rng.uniform(0.0, 2.0), tpot=None, latency=1.0) for i in range(10)]
    records.append(RequestRecord(50, "a", 0.0, error="boom"))
    want = sum(r.ttft <= 1.0 and (r.tpot is None or r.tpot <= 0.1) for r in records if r.error is None) / len(records)  # a failure counts, unmet
    got = summarize(ReplayResult("run", records, wall_s=2.0), 1.0, 0.1)["slo"]["attainment"]
    assert 0 < want < 1 and got == pytest.approx(want)
