"""benchmarks/penalties.py on small batches: the sparse and dense penalties agree, and a row is printed per batch."""
from __future__ import annotations

from benchmarks import penalties


def test_sparse_and_dense_penalties_agree_and_are_timed(capsys):
    assert penalties.main(["--batches", "3x50,2x7", "--prompt-len", "5", "--output-len", "4", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["3x50", "2x7"] and all(line.endswith("x") for line in lines[1:])


def test_a_disagreement_is_reported(capsys, monkeypatch):
    monkeypatch.setattr(penalties, "dense_penalize", lambda z, *rest: z + 1)
    assert penalties.main(["--batches", "2x9", "--rounds", "1", "--prompt-len", "3", "--output-len", "2"]) == 1
    assert "differ" in capsys.readouterr().err
