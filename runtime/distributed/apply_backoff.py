"""When a replica reads a registry entry again after it failed to apply.

A replica stays behind the registry while an entry fails (its folder is broken, not visible on
this node yet, or holds other files than the registered version), so every heartbeat hands it
the state again. Reading and hashing the entry's files at each of them (4 a second) would keep
a node's disk and a CPU busy for as long as nobody fixes the folder. ``ApplyBackoff`` decides
which of those retries really read the files:

- at once when the folder's ``folder_signature`` changed since the last failure (a file was
  written, replaced, added or removed, a symlink repointed): a fixed folder recovers at the
  next heartbeat;
- else once the backoff has passed: ``FIRST_S`` after a failure, doubling after each failed
  read of an unchanged folder, at most ``CAP_S`` (what the signature cannot see, such as a
  network file system that shows new content under old attributes, is still found within
  ``CAP_S``).

Between reads the entry keeps its last error, so the replica reports (and logs) the same failure.
A failure is keyed by (name, path, version, within): an entry the registry changes is read at
once, also when only the folders its read is confined to changed (an admin load of the same files
under another ``--adapter-root``).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Optional

from runtime.lora.adapter import CONFIG_FILE, WEIGHTS_FILE


def folder_signature(folder: str) -> tuple[Hashable, ...]:
    """What changes when an adapter folder's content may have: for the folder and the two files a
    load reads, where each resolves and its stat (inode, size, mtime in ns, mode), or the errno
    for one that cannot be stat'ed. Nothing is opened."""
    signature: list[Hashable] = []
    for path in (Path(folder), Path(folder) / CONFIG_FILE, Path(folder) / WEIGHTS_FILE):
        try:
            st = os.stat(path)
        except OSError as err:
            signature.append((str(path), "error", err.errno))
            continue
        signature.append((os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode))
    return tuple(signature)


def entry_key(entry: dict[str, Any]) -> tuple[Hashable, ...]:
    """What a read of ``entry`` depends on besides its folder's content: its path, its version, and
    the folders the read is confined to (``within``; None: not confined)."""
    within = entry.get("within")
    return entry["path"], entry["version"], tuple(within) if within is not None else None


@dataclass
class _Failure:
    key: tuple[Hashable, ...]  # ``entry_key``: what the registry named when the entry failed
    error: str
    signature: tuple[Hashable, ...]
    retry_at: float
    delay_s: float


class ApplyBackoff:
    FIRST_S = 1.0
    CAP_S = 30.0

    def __init__(self, clock: Callable[[], float] = time.monotonic, signature: Callable[[str], tuple[Hashable, ...]] = folder_signature) -> None:
        self._clock = clock
        self._signature = signature
        self._failures: dict[str, _Failure] = {}

    def held_error(self, entry: dict[str, Any]) -> Optional[str]:
        """The error ``entry`` (a registry entry: name, path, version, within) failed with, when
        reading it again is not due yet; None when it should be read now (it never failed as it is
        named now, ``entry_key``; its folder changed, or the backoff has passed)."""
        failure = self._failures.get(entry["name"])
        if failure is None or failure.key != entry_key(entry):
            return None
        if self._clock() >= failure.retry_at or self._signature(entry["path"]) != failure.signature:
            return None
        return failure.error

    def signature(self, folder: str) -> tuple[Hashable, ...]:
        """``folder``'s signature now: take it before reading the files, and hand it to ``failed``,
        so that a change made while they were read counts as a change."""
        return self._signature(folder)

    def failed(self, entry: dict[str, Any], error: str, signature: tuple[Hashable, ...]) -> None:
        """Reading ``entry`` failed with ``error``; ``signature``: its folder's, taken before the
        read. Back off: twice the last delay (at most ``CAP_S``) when it failed before as named now
        and with the folder as it is, else ``FIRST_S``."""
        name, key = entry["name"], entry_key(entry)
        previous = self._failures.get(name)
        again = previous is not None and previous.key == key and previous.signature == signature
        delay = min(self.CAP_S, previous.delay_s * 2) if again else self.FIRST_S
        self._failures[name] = _Failure(key, error, signature, self._clock() + delay, delay)

    def keep_only(self, names: Any) -> None:
        """Forget every name but ``names`` (those still failing): an applied or unregistered entry
        starts afresh if it fails again."""
        keep = set(names)
        self._failures = {name: f for name, f in self._failures.items() if name in keep}
