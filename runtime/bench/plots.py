"""PNG plots of benchmark results (matplotlib, imported lazily; the 'bench' extra)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError(f"plots need matplotlib (pip install 'lorafleet[bench]'): {err}") from err
    return plt


def throughput_vs_adapters(points: Sequence[tuple[int, float]], baseline: float | None, out: Path) -> Path:
    """points: (adapters, tokens/s); ``baseline``: the no-adapter engine's tokens/s on the same requests, or None."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs, ys = zip(*points)
    ax.plot(xs, ys, "o-", label="lorafleet")
    if baseline is not None:
        ax.axhline(baseline, ls="--", color="gray", label="no adapters")
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(list(xs), [str(x) for x in xs])
    ax.set_xlabel("adapters in the workload")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput vs number of adapters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def p99_vs_rate(points: Sequence[tuple[float, float | None, float | None]], out: Path) -> Path:
    """points: (rate, ttft p99, tpot p99); a None (not measured) is left out, never drawn as 0."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, (marker, label) in enumerate((("o-", "TTFT p99"), ("s-", "TPOT p99")), start=1):
        measured = [(p[0], p[i]) for p in points if p[i] is not None]
        if measured:
            ax.plot(*zip(*measured), marker, label=label)
    ax.set_xlabel("arrival rate (requests / s)")
    ax.set_ylabel("seconds")
    ax.set_title("p99 latency vs arrival rate")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def per_adapter_ttft(ttfts: Mapping[str, Sequence[float]], out: Path) -> Path:
    plt = _plt()
    names = sorted(ttfts, key=lambda n: -len(ttfts[n]))
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * len(names)), 3.5))
    ax.boxplot([list(ttfts[n]) for n in names], showfliers=True)
    ax.set_xticks(range(1, len(names) + 1), names, rotation=70, fontsize=7)
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT per adapter (most popular left)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
