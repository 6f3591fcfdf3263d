"""benchmarks/schedule_steps.py: the tiny-model schedule replay runs and reports consistent counts."""
from __future__ import annotations

import json

import pytest

from benchmarks.schedule_steps import main
from runtime.bench.workload import WorkloadSpec, generate


def test_replay_reports_steps_no_fewer_than_the_bound(capsys, tmp_path):
    assert main(["--sweep-adapters", "4,40", "--num-requests", "24", "--input-len", "4,8", "--output-len", "4,8", "--ranks", "4,8",
                 "--max-loras", "2", "--max-num-seqs", "8", "--workdir", str(tmp_path), "--json"]) == 0  # fmt: skip
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["adapters"] for r in results] == [4, 40] and all(r["requests"] == 24 for r in results)
    for r in results:
        assert r["steps"] >= r["slot_bound"]["lower_bound_steps"] > 0
        spec = WorkloadSpec(num_requests=24, num_adapters=r["adapters"], input_len=(4, 8), output_len=(4, 8), ranks=(4, 8))
        assert r["distinct_adapters"] == len({q.adapter for q in generate(spec).requests if q.adapter is not None})
        assert 0 < r["last_first_token_step_most_popular"] <= r["steps"] and 0 < r["last_first_token_step_least_popular"] <= r["steps"]
    # More distinct adapters through the same two slots cannot take fewer steps' worth of slot time.
    assert results[1]["slot_bound"]["slot_steps"] >= results[0]["slot_bound"]["slot_steps"]


@pytest.mark.parametrize("args, message", [(["--sweep-adapters", "x"], "comma-separated"), (["--sweep-adapters", "0"], ">= 1"),
                                           (["--max-loras", "8", "--max-cpu-loras", "4"], "max-cpu-loras")])  # fmt: skip
def test_bad_arguments_are_one_line_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
