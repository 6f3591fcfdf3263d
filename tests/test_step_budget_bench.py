"""benchmarks/step_budget.py: two engines that differ only by their step budget, stepped in turn."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pytest

from benchmarks import step_budget
from runtime.bench.workload import add_spec_arguments, generate, spec_from_args

# One layer at hidden 128: prompts of 20-30 words (~100-150 byte tokens) cut into chunks by a
# budget of 48 tokens, in one step by 512; ranks mixed, one request in three on the base model.
ARGS = ["--num-requests", "4", "--adapters", "2", "--ranks", "4,8", "--input-len", "20,30", "--output-len", "3,5",
        "--base-fraction", "0.3", "--hidden", "128", "--layers", "1", "--max-num-seqs", "4", "--rounds", "2", "--seed", "5"]


def wanted_tokens() -> int:
    parser = argparse.ArgumentParser()
    add_spec_arguments(parser)
    spec_args, _ = parser.parse_known_args(ARGS)
    return sum(r.output_tokens for r in generate(spec_from_args(spec_args)).requests)


def test_both_budgets_run_every_request_and_the_report_adds_up(tmp_path: Path, capsys) -> None:
    out = tmp_path / "budget.json"
    assert step_budget.main(ARGS + ["--budgets", "48,512", "--workdir", str(tmp_path / "w"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["budgets"] == [48, 512] and len(report["rounds"]) == 2
    for r in report["rounds"]:
        assert r["tokens"] == wanted_tokens()  # every request ran to its length under budget A (and B: same count below)
        small, large = r["steps"]
        assert small > large  # the small budget cut the prompts into more steps: the budget reached the engines
        assert all(t > 0 for t in r["tokens_per_s"])
        assert r["a_over_b"] == pytest.approx(r["busy_s"][1] / r["busy_s"][0], rel=1e-3)  # same tokens: the inverse time ratio
        assert r["requests_with_other_tokens"] == 0  # float32: other chunkings, same greedy tokens here
    assert report["median_a_over_b"] == pytest.approx(statistics.median(r["a_over_b"] for r in report["rounds"]))
    assert "budget 48 / budget 512, stepped in turn (median of 2 rounds)" in capsys.readouterr().out


@pytest.mark.parametrize("budgets", ["256", "256,256", "0,256", "a,b", "1,2,3"])
def test_bad_budgets_are_refused_before_any_work(tmp_path: Path, budgets: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        step_budget.main(ARGS + ["--budgets", budgets, "--workdir", str(tmp_path / "w")])
    assert exit_info.value.code == 2 and "--budgets" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("flag", [["--rate", "2"], ["--rate", "2", "--cv", "2"]])
def test_arrival_flags_are_refused_not_ignored(tmp_path: Path, flag: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        step_budget.main(ARGS + ["--budgets", "48,512", "--workdir", str(tmp_path / "w")] + flag)
    assert "every request runs at once" in capsys.readouterr().err
