"""What the CPU says about itself in ``/proc/cpuinfo`` (Linux): its vendor and model name.

Kernel choices depend on the vendor (``runtime.models.dense``: MKL's sgemm against oneDNN), and
benchmark summaries name the model (``runtime.bench.machine``).
"""
from __future__ import annotations

from pathlib import Path

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
