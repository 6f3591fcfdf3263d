"""Adapter registry: name -> current version, and every version that still has readers.

Registering a name loads and validates the adapter (the caller passes the loaded
``LoRAAdapter``); its content hash is the version. Registering an existing name with
different content makes a new current version; the old version stays known (path and
all) until its last reader, a request bound to it at arrival, has finished.
Unregistering removes the name at once: new requests get ``UnknownAdapterError``,
requests already bound keep their version record until they finish.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from runtime.request import AdapterRef, UnknownAdapterError


@dataclass(frozen=True)
class AdapterInfo:
    """What ``LLMEngine.adapters()`` lists for each registered name."""

    name: str
    version: str
    path: str
    max_rank: int
    registered_at: Optional[float] = None  # Unix time this version became the name's current one


@dataclass
class _VersionRecord:
    ref: AdapterRef
    path: str
    max_rank: int
    readers: int = 0
    registered_at: float = 0.0
    files: tuple[str, ...] = ()  # the files the version was read from, symlinks resolved (a re-read checks them)


def first_of(items: Sequence[str], shown: int = 10) -> str:
    """The first ``shown`` of ``items``, then how many more there are ('none' if empty): an error
    message or log line that lists adapters stays short with thousands of them."""
    if not items:
        return "none"
    head = ", ".join(items[:shown])
    return head if len(items) <= shown else f"{head} and {len(items) - shown} more (GET /v1/models lists them)"


def some_names(names: Iterable[str]) -> str:
    """``first_of`` the names in sorted order."""
    return first_of(sorted(names))


class AdapterRegistry:
    def __init__(self) -> None:
        self._current: dict[str, AdapterRef] = {}
        self._records: dict[AdapterRef, _VersionRecord] = {}
        # name -> its current version's AdapterInfo, kept up to date here: with thousands of
        # adapters, building every entry again for each infos() call was 2 ms at 2000, paid on
        # every register and unregister under the engine lock.
        self._infos: dict[str, AdapterInfo] = {}

    def register(self, ref: AdapterRef, path: str, max_rank: int, files: tuple[str, ...] = ()) -> Optional[AdapterRef]:
        """Make ``ref`` the current version of ``ref.name``; returns the version it replaces (or None).
        ``files``: where its files were read from, symlinks resolved (``LoRAAdapter.files``)."""
        previous = self._current.get(ref.name)
        self._current[ref.name] = ref
        record = self._records.get(ref)
        if record is None:
            record = self._records[ref] = _VersionRecord(ref, path, max_rank, files=files)
        else:
            record.path, record.files = path, files
        if previous != ref:  # registering the current version again keeps its time
            record.registered_at = time.time()
        self._infos[ref.name] = AdapterInfo(ref.name, ref.version, record.path, record.max_rank, record.registered_at)
        if previous is not None and previous != ref:
            self._drop_if_unused(previous)
            return previous
        return None

    def unregister(self, name: str) -> AdapterRef:
        """Remove ``name``; returns its last version. Unknown names raise UnknownAdapterError."""
        ref = self._current.pop(name, None)
        if ref is None:
            raise UnknownAdapterError(f"adapter {name!r} is not registered; registered: {some_names(self._current)}")
        del self._infos[name]
        self._drop_if_unused(ref)
        return ref

    def resolve(self, name: str) -> AdapterRef:
        ref = self._current.get(name)
        if ref is None:
            raise UnknownAdapterError(f"adapter {name!r} is not registered; registered: {some_names(self._current)}")
        return ref

    def acquire(self, ref: AdapterRef) -> None:
        self._records[ref].readers += 1

    def release(self, ref: AdapterRef) -> None:
        record = self._records[ref]
        record.readers -= 1
        if record.readers < 0:
            raise AssertionError(f"adapter {ref} reader count went negative")
        self._drop_if_unused(ref)

    def is_current(self, ref: AdapterRef) -> bool:
        return self._current.get(ref.name) == ref

    def path_of(self, ref: AdapterRef) -> str:
        return self._records[ref].path

    def files_of(self, ref: AdapterRef) -> tuple[str, ...]:
        return self._records[ref].files

    def readers(self, ref: AdapterRef) -> int:
        record = self._records.get(ref)
        return record.readers if record is not None else 0

    def known(self, ref: AdapterRef) -> bool:
        return ref in self._records

    def infos(self) -> list[AdapterInfo]:
        """Every registered name's current version, by name."""
        return [self._infos[name] for name in sorted(self._infos)]

    def _drop_if_unused(self, ref: AdapterRef) -> None:
        record = self._records.get(ref)
        if record is not None and record.readers == 0 and not self.is_current(ref):
            del self._records[ref]
