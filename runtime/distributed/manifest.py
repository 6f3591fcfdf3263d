"""The persisted adapter registry manifest: ``<folder>/adapters.json``.

One JSON document ``{"format": 1, "revision": R, "adapters": {name: {path, version,
max_rank, registered_at[, within]}}}``. ``within`` (a list of folders) is there only for an
adapter the admin route loaded under ``--adapter-root``: every replica's read of its files is
confined to those folders (``LLMEngine.load_adapter_files(within=...)``). An entry without it
(registered by ``--lora-modules``, or in a manifest written before the field existed) has no
confinement recorded, and is read as before. Writes are atomic (temp file in the same folder, fsync,
``os.replace``, fsync of the folder), so a crash leaves either the old or the new
manifest, never a torn one. The manifest outlives replicas, the registry actor and the
whole application; the registry reloads it at start.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

MANIFEST_FILE = "adapters.json"
MANIFEST_FORMAT = 1


class ManifestError(ValueError):
    """The manifest file exists but cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class ManifestEntry:
    """One registered adapter: ``version`` is the content hash the replicas must reproduce;
    ``within``: the folders every replica's read of ``path`` must stay in (None: not confined)."""

    name: str
    path: str
    version: str
    max_rank: int
    registered_at: float
    within: Optional[tuple[str, ...]] = None


@dataclass(frozen=True)
class Manifest:
    revision: int
    entries: tuple[ManifestEntry, ...]

    def by_name(self) -> dict[str, ManifestEntry]:
        return {e.name: e for e in self.entries}


class ManifestStore:
    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser().resolve()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ManifestError(f"registry_dir {self.folder}: cannot create: {err.strerror}") from err
        self.path = self.folder / MANIFEST_FILE

    def load(self) -> Manifest:
        if not self.path.exists():
            return Manifest(0, ())
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ManifestError(f"{self.path}: cannot read the registry manifest: {err}") from err
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f"{self.path}: 'format' must be {MANIFEST_FORMAT}, got {data.get('format') if isinstance(data, dict) else data!r}")
        revision = data.get("revision")
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
            raise ManifestError(f"{self.path}: 'revision' must be a non-negative integer, got {revision!r}")
        adapters = data.get("adapters")
        if not isinstance(adapters, dict):
            raise ManifestError(f"{self.path}: 'adapters' must be an object of name -> entry")
        return Manifest(revision, tuple(_entry(self.path, name, value) for name, value in sorted(adapters.items())))

    def save(self, manifest: Manifest) -> None:
        doc = {
            "format": MANIFEST_FORMAT,
            "revision": manifest.revision,
            "adapters": {e.name: _entry_doc(e) for e in sorted(manifest.entries, key=lambda e: e.name)},
        }
        fd, tmp = tempfile.mkstemp(prefix=".adapters.", suffix=".tmp", dir=self.folder)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)


def check_folder(folder: str | Path) -> Manifest:
    """The manifest the registry would start with in ``folder`` (empty for a folder still to be made),
    or the ManifestError it would start with (a manifest it cannot load, a folder it cannot create),
    leaving nothing behind. Whether a folder can be made is tried, not asked (``os.access`` says yes
    to root on a read-only mount or under /proc)."""
    folder = Path(folder).expanduser().resolve()
    if folder.is_dir():
        return ManifestStore(folder).load()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if existing == folder:
        raise ManifestError(f"registry_dir {folder}: cannot create: File exists")
    if not existing.is_dir():
        raise ManifestError(f"registry_dir {folder}: cannot create: Not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lorafleet-check-", dir=existing))
    except OSError as err:
        raise ManifestError(f"registry_dir {folder}: cannot create: {err.strerror or err}") from None
    return Manifest(0, ())


def _entry(path: Path, name: str, value: Any) -> ManifestEntry:
    where = f"{path}: adapters.{name}"
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: expected an object, got {type(value).__name__}")
    for key, kind in (("path", str), ("version", str), ("max_rank", int), ("registered_at", (int, float))):
        if not isinstance(value.get(key), kind) or isinstance(value.get(key), bool):
            raise ManifestError(f"{where}.{key}: missing or of the wrong type ({value.get(key)!r})")
    within = value.get("within")
    if within is not None and (not isinstance(within, list) or not all(isinstance(r, str) for r in within)):
        raise ManifestError(f"{where}.within: expected a list of folders, got {within!r}")
    return ManifestEntry(name, value["path"], value["version"], int(value["max_rank"]), float(value["registered_at"]),
                         tuple(within) if within is not None else None)


def _entry_doc(entry: ManifestEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"path": entry.path, "version": entry.version, "max_rank": entry.max_rank, "registered_at": entry.registered_at}
    if entry.within is not None:  # absent, not null: what a manifest written before the field looks like
        doc["within"] = list(entry.within)
    return doc
