"""The mode a plain ``open()`` gives a new file: ``0o666`` minus the process umask.

For files created another way (``tempfile.mkstemp`` and safetensors' ``save_file`` make them
0600), so that another account, such as the one running the server, can read them.
"""
from __future__ import annotations

import os
from pathlib import Path


def new_file_mode() -> int:
    """``0o666 & ~umask``."""
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process umask, read from ``/proc/self/status`` (Linux 4.7+). Elsewhere os has no getter:
    it is set and put back, which for that moment gives files that other threads create mode 0666."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask
