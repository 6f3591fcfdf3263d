"""The mode a plain ``open()`` gives a new file: ``0o666`` minus the process umask.

For files created another way (``tempfile.mkstemp`` and safetensors' ``save_file`` make them
0600), so that another account, such as the one running the server, can read them.
"""
from __future__ import annotations

import os


def new_file_mode() -> int:
    """``0o666 & ~umask``. Reading the umask means setting it and putting it back (os has no getter)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
