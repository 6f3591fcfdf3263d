"""runtime/bench/machine.py: the machine a benchmark's figures came from."""
from __future__ import annotations

import platform
from pathlib import Path

import torch

from runtime.bench import machine


def test_the_cpu_model_is_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu\n\n"
                    "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor\n")
    assert machine.cpu_model(info) == "Intel(R) Xeon(R) Processor"


def test_without_cpuinfo_or_its_line_the_platform_answers(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert machine.cpu_model(tmp_path / "missing") == "arm"
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t:   \n")  # an empty name, as some VMs print
    assert machine.cpu_model(tmp_path / "cpuinfo") == "arm"
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert machine.cpu_model(tmp_path / "missing") == "unknown"


def test_describe_names_the_cpu_the_cores_and_torch() -> None:
    info = machine.describe()
    assert info["cpu"] == machine.cpu_model() and 1 <= info["cores"] and info["torch"] == torch.__version__
    assert info["torch_threads"] == torch.get_num_threads() and info["arch"] == platform.machine()
    assert ("gpu" in info) == torch.cuda.is_available()


def test_a_cpuinfo_field_is_read_or_is_empty(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t:\n")
    assert machine.cpu_field("vendor_id", info) == "GenuineIntel" and machine.cpu_field("model name", info) == "Intel(R) Xeon(R) Processor"
    assert machine.cpu_field("vendor_id", tmp_path / "missing") == "" and machine.cpu_field("flags", info) == "" and machine.cpu_field("bogus", info) == ""
