"""The output folder of `lorafleet merge` / `lorafleet quantize`: written in a staging folder, published by rename.

    check_output(out, inputs, force)   refuse before any work: out equal to / inside / above an
                                       input or around the current folder, an empty --out, out
                                       existing without --force, with --force a folder that is
                                       neither empty nor exactly an earlier lorafleet output (its
                                       manifest, lorafleet_merge.json or lorafleet_quantize.json,
                                       lists everything else it holds), a parent that is missing
                                       or not a folder
    with StagedOutput(out, force) as tmp:
        ... write everything into tmp ...
        staged.publish()               rename tmp -> out (with --force the old out is moved
                                       aside first, then deleted)

The staging folder is a hidden sibling of ``out`` (same filesystem, so the final rename is
atomic). If anything raises before ``publish``, the staging folder is deleted: a failed run
leaves nothing behind and the old ``out`` (with --force) is untouched. That includes SIGTERM
and SIGHUP while the block runs (in the main thread they raise ``SystemExit(128 + signal)``,
so the cleanup runs) and Ctrl-C (``KeyboardInterrupt``). From the start of ``publish`` to the end
of the with-block (the swap of the folders, then the deletion of the previous output with
--force), all three are held: a signal that arrives then finds the new output in place, so the
run finishes normally, deletes the previous output, and says on stderr that the signal came too
late to stop it. Only SIGKILL
or a crash can leave a staging folder; the next run into the same ``out`` lists such leftovers.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, Iterable

from runtime.merge.manifest import MERGE_MANIFEST, QUANTIZE_MANIFEST, folder_entries

TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class OutputPathError(ValueError):
    """The output path cannot be used; the message names it and says why."""


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_output(out: str | Path, inputs: Iterable[str | Path], force: bool) -> Path:
    """Resolve ``out`` and refuse every unsafe or impossible destination (see module docstring)."""
    if not str(out).strip():  # Path("") is the current folder: an unset "$OUT" must not write there
        raise OutputPathError("--out is empty; give the folder to write")
    target = Path(out).expanduser().resolve()
    if _within(Path.cwd().resolve(), target):
        raise OutputPathError(f"{out}: the output folder is, or contains, the current folder; the output folder is written as a "
                              "whole: choose another folder")  # fmt: skip
    for raw in inputs:
        src = Path(raw).expanduser().resolve()
        if _within(target, src):
            raise OutputPathError(f"{out}: the output folder is {'the same as' if target == src else 'inside'} the input {raw}; it would write over its input")
        if _within(src, target):
            raise OutputPathError(f"{out!r}: the output folder contains the input {raw}; the output folder is written as a whole, "
                                  "which would delete the input: choose a folder outside it")
    if target.exists() or target.is_symlink():
        if not force:
            raise OutputPathError(f"{out}: already exists; choose a new folder or pass --force to replace it")
        if not target.is_dir():
            raise OutputPathError(f"{out}: exists and is not a folder; refusing to replace it even with --force")
        foreign = _not_written_by_lorafleet(target)
        if foreign:
            raise OutputPathError(
                f"{out}: holds files that lorafleet did not write ({foreign}); --force only replaces an empty folder or "
                "exactly an earlier merge/quantize output. Remove them yourself or choose another folder"
            )
    parent = target.parent
    if not parent.exists():
        raise OutputPathError(f"{out}: the parent folder {parent} does not exist")
    if not parent.is_dir():
        raise OutputPathError(f"{out}: the parent {parent} is not a folder")
    return target


def _not_written_by_lorafleet(folder: Path) -> str:
    """What in ``folder`` its lorafleet manifest does not list, said in a few words: '' when ``--force``
    may replace it (an empty folder, or exactly an earlier merge/quantize output)."""
    if not any(folder.iterdir()):
        return ""
    manifest = next((folder / m for m in (MERGE_MANIFEST, QUANTIZE_MANIFEST) if (folder / m).is_file()), None)
    if manifest is None:
        return f"no {MERGE_MANIFEST} or {QUANTIZE_MANIFEST}"
    try:
        written = json.loads(manifest.read_text()).get("files_written")
    except (OSError, ValueError, AttributeError):
        written = None
    if not isinstance(written, list) or not all(isinstance(w, str) for w in written):
        return f"{manifest.name} does not list the files it wrote (an older lorafleet, or not its own)"
    extra = sorted(set(folder_entries(folder)) - set(written) - {manifest.name})
    if not extra:
        return ""
    return ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")


class StagedOutput:
    """Context manager over a hidden staging folder next to ``out`` (see module docstring)."""

    def __init__(self, out: Path, force: bool) -> None:
        self.out = out
        self.force = force
        self.path: Path | None = None
        self.published = False
        self._previous_handlers: dict[int, Any] = {}
        self._holding = False  # from publish() to the end of the with-block
        self._held_signal: int | None = None

    def __enter__(self) -> Path:
        leftovers = leftover_scratch(self.out)
        if leftovers:
            print(f"note: {len(leftovers)} folder(s) left by an interrupted earlier run into {self.out} (delete them if no "
                  "other run writes there now): " + ", ".join(str(p) for p in leftovers), file=sys.stderr)  # fmt: skip
        # os.mkdir (not mkdtemp, which makes 0700) so the published folder gets the umask's usual mode.
        path = self.out.parent / f".{self.out.name}.staging-{uuid.uuid4().hex[:12]}"
        try:
            os.mkdir(path)
            self.path = path
        except OSError as err:
            raise OutputPathError(f"{self.out}: cannot write into {self.out.parent}: {err.strerror or err}") from err
        self._previous_handlers = _install_termination_handler(self._on_termination)
        return self.path

    def _on_termination(self, signum: int, frame: Any) -> None:
        """SIGTERM/SIGHUP: ``SystemExit(128 + signum)``, SIGINT: ``KeyboardInterrupt``, so the cleanup
        runs; held (noted, not raised) from ``publish`` on."""
        if self._holding:
            self._held_signal = signum
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def publish(self) -> None:
        """Move the staging folder to ``out``; with --force the previous ``out`` is replaced, then deleted.

        SIGTERM, SIGHUP and SIGINT are held from here to the end of the with-block: none can land
        between the two renames and leave neither the old nor the new output in place, nor stop the
        deletion of the previous output half-way, nor be reported as "nothing was written" once the
        new output is in place. One that arrived meanwhile is reported on stderr when the block ends."""
        assert self.path is not None, "publish() outside the with-block"
        self._holding = True
        old = self._swap_in()
        if old is not None:
            try:
                shutil.rmtree(old)
            except OSError as err:  # e.g. EBUSY on NFS while a server still reads the old weights: the new output stands
                print(f"lorafleet merge: warning: the new output is in {self.out}, but the previous one could not be deleted "
                      f"({err.strerror or err}); it is left in {old}: delete it yourself", file=sys.stderr)  # fmt: skip

    def _swap_in(self) -> Path | None:
        """Rename staging -> out (the previous out moved aside first); returns where the previous out went."""
        assert self.path is not None
        old: Path | None = None
        if self.out.exists() or self.out.is_symlink():
            if not self.force:  # appeared while we were writing
                raise OutputPathError(f"{self.out}: appeared while writing; not replaced without --force")
            # Checked again: a run takes minutes, and files may have been added (or the folder made) meanwhile.
            self._refuse_foreign(self.out)
            old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
            os.rename(self.out, old / "previous")
            try:  # and once more where nobody writes: a file added between the check and the rename
                self._refuse_foreign(old / "previous")
            except (OutputPathError, OSError) as err:
                why = str(err) if isinstance(err, OutputPathError) else f"{self.out}: cannot check it: {err.strerror or err}"
                try:
                    os.rename(old / "previous", self.out)
                    old.rmdir()
                except OSError as put_back:  # e.g. someone made a new --out meanwhile
                    raise OutputPathError(f"{why}; the previous output could not be put back ({put_back.strerror or put_back}) and is in "
                                          f"{old / 'previous'}") from err  # fmt: skip
                raise OutputPathError(why) from err
        try:
            os.rename(self.path, self.out)
        except OSError as err:
            if old is not None:  # put the previous output back
                os.rename(old / "previous", self.out)
                old.rmdir()
            raise OutputPathError(f"{self.out}: cannot move the finished output into place: {err.strerror or err}") from err
        self.published = True
        return old

    def _refuse_foreign(self, folder: Path) -> None:
        """OutputPathError unless ``folder`` (``out``, or where it was moved aside) may be replaced:
        an empty folder, or exactly an earlier lorafleet output."""
        if folder.is_symlink() or not folder.is_dir():
            raise OutputPathError(f"{self.out}: is no longer a folder; not replaced")
        foreign = _not_written_by_lorafleet(folder)
        if foreign:
            raise OutputPathError(f"{self.out}: holds files that lorafleet did not write ({foreign}), added while this run wrote; "
                                  "not replaced, and nothing was written")  # fmt: skip

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if not self.published and self.path is not None and self.path.exists():
                shutil.rmtree(self.path)
        finally:
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
            self._previous_handlers = {}
            self._holding = False
            if self._held_signal is not None:
                name = signal.Signals(self._held_signal).name
                state = f"the new output is in place in {self.out}" if self.published else f"{self.out} was not replaced"
                print(f"note: {name} arrived while the output was being moved into place; {state}", file=sys.stderr)


def leftover_scratch(out: Path) -> list[Path]:
    """Hidden staging and verification folders of earlier runs into ``out`` that were killed before cleanup."""
    if not out.parent.is_dir():
        return []
    prefixes = (f".{out.name}.staging-", f".{out.name}.verify-", f".{out.name}.old-")
    return sorted(p for p in out.parent.iterdir() if p.is_dir() and p.name.startswith(prefixes))


def _install_termination_handler(handler: Any) -> dict[int, Any]:
    """``handler`` for SIGTERM, SIGHUP and SIGINT (main thread only: Python runs signal handlers
    there); returns the old handlers. A signal the process was started ignoring stays ignored:
    under ``nohup`` SIGHUP, and in a shell's background job SIGINT, must not stop the run."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, handler) for signum in TERMINATING_SIGNALS if signal.getsignal(signum) is not signal.SIG_IGN}
