"""Smoke test of benchmarks/merge_vs_dynamic.py: it runs, and its JSON is complete and internally
consistent. Never timings: no threshold on any throughput or on which side wins."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "merge_vs_dynamic.py"


def _tps_matches(tokens: int, wall_s: float, tokens_per_s: float) -> bool:
    """tokens_per_s = tokens / wall time, with wall_s reported to 1 ms and tokens_per_s to 0.1."""
    return tokens / (wall_s + 5e-4) - 0.05 <= tokens_per_s <= tokens / max(wall_s - 5e-4, 1e-9) + 0.05


def test_help_runs() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--hidden", "--layers", "--requests", "--prompt-len", "--max-tokens", "--out"):
        assert flag in proc.stdout


def test_merge_vs_dynamic_smoke(tmp_path: Path) -> None:
    out = tmp_path / "merge_vs_dynamic.json"
    requests, max_tokens = 9, 3  # 9: the N = 2, 4, 8 shares are uneven, and must still cover every request
    cmd = [sys.executable, str(SCRIPT), "--hidden", "64", "--layers", "1", "--requests", str(requests), "--prompt-len", "4",
           "--max-tokens", str(max_tokens), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert json.loads(proc.stdout) == res  # the same JSON on stdout and in --out
    assert res["model"]["hidden_size"] == 64 and res["model"]["num_hidden_layers"] == 1  # --hidden/--layers are honoured
    assert res["config"]["requests"] == requests and res["rank"] == 16
    want_tokens = requests * max_tokens  # ignore_eos: every request generates max_tokens
    for name in ("merged_single", "dynamic_single", "dynamic_mixed_8"):
        r = res[name]
        assert set(r) == {"tokens", "wall_s", "tokens_per_s"}, name
        assert r["tokens"] == want_tokens and r["tokens_per_s"] > 0, name
        assert _tps_matches(r["tokens"], r["wall_s"], r["tokens_per_s"]), (name, r)
    by_n = res["by_adapter_count"]
    assert list(by_n) == ["1", "2", "4", "8"]
    for n, c in by_n.items():
        assert set(c) == {"merged_fleet_tokens_per_s", "dynamic_mixed_tokens_per_s", "merged_fleet_tokens", "merged_fleet_wall_s"}, n
        assert c["merged_fleet_tokens"] == want_tokens, n  # the N merged models together serve every request
        assert c["merged_fleet_tokens_per_s"] > 0 and c["dynamic_mixed_tokens_per_s"] > 0, n
        assert _tps_matches(c["merged_fleet_tokens"], c["merged_fleet_wall_s"], c["merged_fleet_tokens_per_s"]), (n, c)
    # N = 1 is the single-adapter pair; N = 8's dynamic side is the 8-adapter run
    assert by_n["1"]["merged_fleet_tokens_per_s"] == res["merged_single"]["tokens_per_s"]
    assert by_n["1"]["dynamic_mixed_tokens_per_s"] == res["dynamic_single"]["tokens_per_s"]
    assert by_n["8"]["dynamic_mixed_tokens_per_s"] == res["dynamic_mixed_8"]["tokens_per_s"]
    # the crossover is the smallest N where the merged fleet is not faster, or None
    slower = [int(n) for n, c in by_n.items() if c["merged_fleet_tokens_per_s"] <= c["dynamic_mixed_tokens_per_s"]]
    assert res["crossover_adapters"] == (min(slower) if slower else None)


def test_refuses_too_few_requests() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--requests", "4"], cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 2 and "--requests must be >= 8" in proc.stderr
