"""The output folder of `lorafleet merge` / `lorafleet quantize`: written in a staging folder, published by rename.

    check_output(out, inputs, force)   refuse before any work: out equal to / inside / above an
                                       input, out existing without --force, a parent that is
                                       missing or not a folder
    with StagedOutput(out, force) as tmp:
        ... write everything into tmp ...
        staged.publish()               rename tmp -> out (with --force the old out is moved
                                       aside first, then deleted)

The staging folder is a hidden sibling of ``out`` (same filesystem, so the final rename is
atomic). If anything raises before ``publish``, the staging folder is deleted: a failed run
leaves nothing behind and the old ``out`` (with --force) is untouched.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from types import TracebackType
from typing import Iterable


class OutputPathError(ValueError):
    """The output path cannot be used; the message names it and says why."""


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_output(out: str | Path, inputs: Iterable[str | Path], force: bool) -> Path:
    """Resolve ``out`` and refuse every unsafe or impossible destination (see module docstring)."""
    target = Path(out).expanduser().resolve()
    for raw in inputs:
        src = Path(raw).expanduser().resolve()
        if _within(target, src):
            raise OutputPathError(f"{out}: the output folder is {'the same as' if target == src else 'inside'} the input {raw}; it would write over its input")
        if _within(src, target):
            raise OutputPathError(f"{out}: the output folder contains the input {raw}; --force would delete the input")
    if target.exists() or target.is_symlink():
        if not force:
            raise OutputPathError(f"{out}: already exists; choose a new folder or pass --force to replace it")
        if not target.is_dir():
            raise OutputPathError(f"{out}: exists and is not a folder; refusing to replace it even with --force")
    parent = target.parent
    if not parent.exists():
        raise OutputPathError(f"{out}: the parent folder {parent} does not exist")
    if not parent.is_dir():
        raise OutputPathError(f"{out}: the parent {parent} is not a folder")
    return target


class StagedOutput:
    """Context manager over a hidden staging folder next to ``out`` (see module docstring)."""

    def __init__(self, out: Path, force: bool) -> None:
        self.out = out
        self.force = force
        self.path: Path | None = None
        self.published = False

    def __enter__(self) -> Path:
        # os.mkdir (not mkdtemp, which makes 0700) so the published folder gets the umask's usual mode.
        path = self.out.parent / f".{self.out.name}.staging-{uuid.uuid4().hex[:12]}"
        try:
            os.mkdir(path)
            self.path = path
        except OSError as err:
            raise OutputPathError(f"{self.out}: cannot write into {self.out.parent}: {err.strerror or err}") from err
        return self.path

    def publish(self) -> None:
        """Move the staging folder to ``out``; with --force the previous ``out`` is replaced."""
        assert self.path is not None, "publish() outside the with-block"
        old: Path | None = None
        if self.out.exists():
            if not self.force:  # appeared while we were writing
                raise OutputPathError(f"{self.out}: appeared while writing; not replaced without --force")
            old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
            os.rename(self.out, old / "previous")
        try:
            os.rename(self.path, self.out)
        except OSError as err:
            if old is not None:  # put the previous output back
                os.rename(old / "previous", self.out)
                old.rmdir()
            raise OutputPathError(f"{self.out}: cannot move the finished output into place: {err.strerror or err}") from err
        self.published = True
        if old is not None:
            shutil.rmtree(old)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if not self.published and self.path is not None and self.path.exists():
            shutil.rmtree(self.path)
