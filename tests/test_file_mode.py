"""new_file_mode reads the umask without changing it (setting and restoring it, as before, gave
files that other threads created meanwhile mode 0666)."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from runtime.file_mode import new_file_mode


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/self/status (Linux)")
def test_new_file_mode_leaves_the_umask_alone_while_other_threads_create_files(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        assert new_file_mode() == 0o600
        stop = threading.Event()

        def ask() -> None:
            while not stop.is_set():
                new_file_mode()

        asker = threading.Thread(target=ask)
        asker.start()
        try:
            modes = set()
            for k in range(2000):
                path = tmp_path / f"f{k}"
                path.touch()
                modes.add(path.stat().st_mode & 0o777)
        finally:
            stop.set()
            asker.join()
        assert modes == {0o600}
    finally:
        os.umask(old)
