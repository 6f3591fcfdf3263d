"""Running `lorafleet bench` in-process from tests."""
from __future__ import annotations

import pytest

from runtime.cli import main


def bench_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """(exit code, stderr) of `lorafleet bench ARGV`; an argparse error is its SystemExit code."""
    try:
        rc = main(["bench", *argv])
    except SystemExit as stop:
        rc = int(stop.code or 0)
    return rc, capsys.readouterr().err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]
