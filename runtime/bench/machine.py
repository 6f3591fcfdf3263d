"""The machine a benchmark ran on, recorded next to its figures.

Figures from different machines are not comparable: the CPU development machines of this project
have been AMD EPYC and Intel Xeon VMs of the same size on different days (docs/benchmarks.md), and
they disagree even on which GEMM kernel is faster at some sizes (MKL won at hidden 512 on the Xeon only). So every
summary says which machine it was.
"""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")


def cpu_field(name: str, cpuinfo: Path = CPUINFO) -> str:
    """The first non-empty ``name : value`` of ``cpuinfo`` (e.g. ``vendor_id`` -> "GenuineIntel",
    ``model name``), or "" where the file or the field is missing (other OSes, some ARM kernels)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name and value.strip():
            return value.strip()
    return ""


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's marketing name: Linux's ``model name`` line, else ``platform.processor()``, else "unknown"."""
    return cpu_field("model name", cpuinfo) or platform.processor() or "unknown"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one, else every core)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def describe() -> dict[str, Any]:
    """cpu, cores, architecture, python, torch and its intra-op threads; the GPU's name when torch sees one."""
    import torch

    info: dict[str, Any] = {"cpu": cpu_model(), "cores": usable_cores(), "arch": platform.machine(),
                            "python": sys.version.split()[0], "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
