"""What the CPU says about itself in ``/proc/cpuinfo`` (Linux): its vendor and model name, which
benchmark summaries record (``runtime.bench.machine``): the dev machines' CPUs changed between
sessions, and so did their figures.
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
