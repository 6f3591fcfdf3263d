"""Open a file by a resolved path without following any symlink, so a checked path cannot be redirected.

A confinement check resolves a path once (``os.path.realpath``: no symlink, no ``..`` left) and
decides on the result. A plain ``open`` of that result resolves it again, and a symlink swapped
into any of its components in between (the file, or a folder above it) redirects the open to
wherever that symlink points: the time-of-check to time-of-use race.

``open_symlink_free`` closes it on POSIX: it walks the path from ``/`` one component at a time,
opening each folder with ``O_DIRECTORY | O_NOFOLLOW`` (and Linux's ``O_PATH``: search permission
is enough, as for a plain open) relative to the previous one's descriptor (``dir_fd``), and the
file with ``O_NOFOLLOW | O_NONBLOCK``. The kernel follows no symlink at any
step, so the descriptor returned is the file that sits at exactly the checked path, reached through
real folders, when each step was taken; a component that is a symlink by then fails the open with
``SymlinkInPathError``, nothing read. (Checking after a plain open instead, comparing ``os.fstat``
of the descriptor with a ``stat`` of the path, is not race-free: the symlink can be swapped back
between the open and that ``stat``, and a folder above swapped to a symlink at the same time, so
the ``stat`` sees the file that was opened.) ``O_NONBLOCK`` keeps a FIFO put there meanwhile from
blocking the open; anything but a regular file is ``NotRegularFileError``.

What is not caught: a hard link inside the checked folder to a file elsewhere is that file at the
checked path (no race needed for it; with ``fs.protected_hardlinks``, on in most Linux
distributions, nobody can hard-link a file they may not read). A real folder moved (renamed, not
replaced by a symlink) while the walk holds it is still walked: the walk makes sure no symlink is
followed, not where real folders were moved to; moving one in from outside the checked root, or
out of it, takes write access outside the root.

Without Linux's ``O_PATH`` (macOS, the BSDs) each folder on the way is opened ``O_RDONLY``, which
needs read permission on it where a plain open needs only search permission: there, a path through
a search-only (``--x``) folder fails with "permission denied".

Where ``os.open`` has no ``O_NOFOLLOW`` or no ``dir_fd`` (Windows), the path is opened plainly
(``SYMLINK_FREE``: False) and the race stays open there; docs/security.md says so.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import PurePosixPath
from typing import BinaryIO

SYMLINK_FREE = hasattr(os, "O_NOFOLLOW") and hasattr(os, "O_DIRECTORY") and os.open in os.supports_dir_fd
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# A folder on the way is opened only to name it as ``dir_fd``: with Linux's O_PATH that needs only
# search permission on it, as a plain open of the path does (an O_RDONLY open would need read permission).
_FOLDER = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC if SYMLINK_FREE else 0


class SymlinkInPathError(OSError):
    """A component of a path that was checked free of symlinks is a symlink now: nothing was opened."""


class NotRegularFileError(OSError):
    """The path names a folder, FIFO, device or socket, not a regular file: it was not read."""


def open_symlink_free(path: str) -> BinaryIO:
    """The regular file at ``path`` (absolute, resolved: ``os.path.realpath``'s result), opened for
    binary reading with no symlink followed on the way (module docstring). Raises
    ``SymlinkInPathError`` when a component is a symlink, ``NotRegularFileError`` for anything but
    a regular file, and the ``OSError`` of the failing step otherwise (missing, no permission)."""
    if not os.path.isabs(path):
        raise ValueError(f"{path!r}: expected an absolute, resolved path")
    if not SYMLINK_FREE:
        return open(path, "rb")  # the declared fallback: no O_NOFOLLOW / dir_fd here
    parts = PurePosixPath(path).parts[1:]
    if not parts:
        raise NotRegularFileError(errno.EISDIR, "is a folder, not a regular file", path)
    fd = os.open("/", _FOLDER)
    try:
        for depth, name in enumerate(parts):
            last = depth == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC if last else _FOLDER
            try:
                child = os.open(name, flags, dir_fd=fd)
            except OSError as err:
                if _is_symlink(name, fd):
                    where = "/" + "/".join(parts[: depth + 1])
                    raise SymlinkInPathError(errno.ELOOP, f"{where} is a symlink now; it was not when the path was checked", path) from None
                raise OSError(err.errno, err.strerror, path) from None
            os.close(fd)
            fd = child
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError(errno.EINVAL, "not a regular file", path)
        opened = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    return opened


def _is_symlink(name: str, dir_fd: int) -> bool:
    """Whether ``name`` in ``dir_fd`` is a symlink (only to word an error; never decides what is read)."""
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False
