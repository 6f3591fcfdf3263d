"""benchmarks/shared_prompt.py on a tiny model: the waiting variant reuses blocks, the other none."""
from __future__ import annotations

import re

from benchmarks.shared_prompt import main


def test_waiting_copies_reuse_the_shared_prompt(capsys):
    assert main(["--copies", "3", "--prompt-len", "33", "--max-tokens", "2", "--rounds", "1", "--hidden", "64", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    hits = [int(h) for h in re.findall(r"hit blocks (\d+)", out)]
    assert hits[0] == 2 * (32 // 16) and hits[1] == 0, out  # default block size 16: two copies reuse 2 blocks each
    assert "faster" in out
