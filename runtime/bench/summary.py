"""Figures from replay records: throughput, TTFT/TPOT percentiles, SLO attainment, per adapter.

Percentiles use linear interpolation between closest ranks (numpy's default).
SLO attainment = share of requests that finished without error with
``ttft <= slo_ttft_s`` and ``tpot <= slo_tpot_s``. A one-token answer has no TPOT (no gap
between tokens): it is left out of the TPOT percentiles and meets the TPOT half of the SLO.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any, Optional, Sequence

from runtime.bench.replay import ReplayResult, RequestRecord

BASE = "__base__"


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    """The median: the middle value, or the mean of the two middle ones for an even count."""
    return statistics.median(values)


def median_round(runs: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """Of one config's runs in several rounds, the one with the median ``key``; for an even
    count, the upper of the two middle runs (a row of the table is always one measured run)."""
    return sorted(runs, key=lambda r: r[key])[len(runs) // 2]


def _latency_block(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Percentiles over completed requests (``records`` are those); ``requests_ok`` counts them."""
    ttft = [r.ttft for r in records if r.ttft is not None]
    tpot = [r.tpot for r in records if r.tpot is not None]
    return {
        "requests_ok": len(records),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
    }


def summarize(result: ReplayResult, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
    ok = [r for r in result.records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    met = [r for r in ok if r.ttft is not None and r.ttft <= slo_ttft_s and (r.tpot is None or r.tpot <= slo_tpot_s)]
    per_adapter: dict[str, list[RequestRecord]] = defaultdict(list)
    by_location: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in ok:
        per_adapter[r.adapter or BASE].append(r)
        if r.adapter_location is not None:
            by_location[r.adapter_location].append(r)
    # Pool counters come from the engine's snapshot; a run without one (over HTTP, or the PEFT
    # baseline) did not measure them: None, not zero.
    measured = bool(result.snapshot)
    pool_counters = result.snapshot.get("adapters", {}) if measured else {}
    swaps = sum(c.get("device_loads", 0) for c in pool_counters.values()) if measured else None
    hits = {k: sum(c.get(k, 0) for c in pool_counters.values()) if measured else None for k in ("device_hits", "host_hits", "disk_misses")}
    arrivals = sum(hits.values()) if measured else 0
    return {
        "label": result.label,
        "wall_s": result.wall_s,
        "requests_ok": len(ok),
        "requests_failed": len(result.records) - len(ok),
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "throughput_tokens_per_s": out_tokens / result.wall_s if result.wall_s > 0 else 0.0,
        "throughput_requests_per_s": len(ok) / result.wall_s if result.wall_s > 0 else 0.0,
        **_latency_block(ok),
        # No streamed timings (e.g. the PEFT baseline): attainment is unknown, not zero; every request failed: zero.
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s,
                "attainment": (len(met) / len(result.records) if any(r.ttft is not None for r in ok) else None) if ok
                else (0.0 if result.records else None)},
        "adapter_swaps": swaps,
        "engine_steps": result.snapshot.get("steps") if measured else None,
        "cache": {**hits, "device_hit_rate": hits["device_hits"] / arrivals if arrivals else None,
                  "host_or_device_hit_rate": (hits["device_hits"] + hits["host_hits"]) / arrivals if arrivals else None},
        "ttft_by_adapter_location": {loc: _latency_block(rs) for loc, rs in sorted(by_location.items())},
        "per_adapter": {name: _latency_block(rs) for name, rs in sorted(per_adapter.items())},
        "memory": result.memory,
        "peak_rss_bytes": result.peak_rss_bytes,
        "errors": sorted({r.error for r in result.records if r.error})[:5],
    }


def ttft_by_adapter(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """TTFTs of the completed requests, by adapter (``BASE`` for the base model's rows)."""
    ttfts: dict[str, list[float]] = {}
    for rec in records:
        if rec.ttft is not None and rec.error is None:  # as the summary's percentiles: failed requests are not timed
            ttfts.setdefault(rec.adapter or BASE, []).append(rec.ttft)
    return ttfts


def fairness(ttfts: dict[str, list[float]]) -> Optional[dict[str, Any]]:
    """p99 TTFT of the least popular adapter / that of the most popular, popularity being the
    number of completed requests (the base rows left out); None with fewer than two adapters.
    Ties count on both sides, against the engine: the best p99 of the adapters tied for the most
    requests, the worst p99 of those tied for the fewest (often many one-request adapters).
    ``ratio`` is None when the most popular adapter's p99 is 0."""
    popular = sorted((n for n in ttfts if n != BASE), key=lambda n: -len(ttfts[n]))
    if len(popular) < 2:
        return None
    top = [n for n in popular if len(ttfts[n]) == len(ttfts[popular[0]])]
    rare = [n for n in popular if len(ttfts[n]) == len(ttfts[popular[-1]])]
    most = min(percentile(ttfts[n], 99) for n in top)
    least = max(percentile(ttfts[n], 99) for n in rare)
    return {"most_popular": top, "most_popular_p99_ttft_s": most, "least_popular": rare, "least_popular_p99_ttft_s": least,
            "ratio": least / most if most else None}


def table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of the headline figures of several summaries."""
    head = f"{'run':<28} {'ok':>4} {'fail':>4} {'tok/s':>9} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'SLO':>5} {'swaps':>5}"
    lines = [head, "-" * len(head)]

    def ms(v: Optional[float]) -> str:
        return f"{1000 * v:8.1f}ms" if v is not None else f"{'-':>10}"

    def slo(v: Optional[float]) -> str:
        return f"{v:>5.2f}" if v is not None else f"{'-':>5}"

    for s in rows:
        lines.append(
            f"{s['label']:<28} {s['requests_ok']:>4} {s['requests_failed']:>4} {s['throughput_tokens_per_s']:>9.1f} "
            f"{s['throughput_requests_per_s']:>7.2f} {ms(s['ttft_p50_s'])} {ms(s['ttft_p99_s'])} {ms(s['tpot_p50_s'])} "
            f"{ms(s['tpot_p99_s'])} {slo(s['slo']['attainment'])} {'-' if s['adapter_swaps'] is None else s['adapter_swaps']:>5}"
        )
    return "\n".join(lines)
