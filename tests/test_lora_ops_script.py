"""benchmarks/lora_ops.py keeps what it measured when a later section fails (a GPU run has one try)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import lora_ops  # noqa: E402

_ALL_CASES = lora_ops.cases


def _first_case(device: str):
    return _ALL_CASES(device)[:1]


def test_a_failing_section_is_recorded_and_the_rest_is_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lora_ops, "cases", _first_case)  # one op case keeps the test short

    def broken(*args, **kwargs):
        raise RuntimeError("illegal memory access (simulated)")

    monkeypatch.setattr(lora_ops, "bench_tax", broken)
    out = tmp_path / "lo.json"
    assert lora_ops.main(["--device", "cpu", "--skip-model", "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert isinstance(result["ops"], list) and result["ops"], "the op rows measured before the failure are kept"
    assert result["tax_stack"]["error"] == "RuntimeError: illegal memory access (simulated)" and "Traceback" in result["tax_stack"]["traceback"]
    assert "tax_stack: FAILED" in capsys.readouterr().err
    assert not (tmp_path / "lo.json.partial").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_an_unavailable_device_is_one_line_with_exit_2(capsys) -> None:
    import subprocess

    with pytest.raises(SystemExit) as stop:
        lora_ops.main(["--device", "cuda"])
    assert stop.value.code == 2 and "cuda: torch.cuda.is_available() is False" in capsys.readouterr().err
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--out", "unused", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().endswith("serve.py: error: cuda: torch.cuda.is_available() is False")
    assert "Traceback" not in done.stderr and not Path("unused").exists()
