"""The JSON record written next to merged / quantized weights, so they trace back to their sources.

``lorafleet_merge.json``::

    {"kind": "merge", "lorafleet_version", "created_utc" (ISO 8601),
     "base": {"id", "path", "weights_sha256", "quantization" (scheme or null)},
     "adapter": {"name", "version" (content hash, as serving uses), "path", "r", "lora_alpha",
                 "use_rslora", "rank_pattern", "alpha_pattern",
                 "scales": {"model.layers.0.self_attn.q_proj": 2.0, ...}},
     "output": {"dtype", "quantization" (scheme or null), "flow"},
     "verification": {...figures...} or {"skipped": true}}

``lorafleet_quantize.json`` has the same ``base`` / ``output`` / time / version fields.

Both end with ``"files_written"``: every file and folder of the output besides the manifest,
relative, folders ending in ``/`` (``folder_entries``). ``--force`` replaces an earlier output
only when it holds nothing else.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
from pathlib import Path
from typing import Any, Mapping

from runtime.lora.adapter import LoRAAdapter
from runtime.merge.merger import module_weight_name

MERGE_MANIFEST = "lorafleet_merge.json"
QUANTIZE_MANIFEST = "lorafleet_quantize.json"


def lorafleet_version() -> str:
    try:
        return importlib.metadata.version("lorafleet")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def base_record(model_id: str, path: Path, weights_sha256: str, quantization: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"id": model_id, "path": str(path.resolve()), "weights_sha256": weights_sha256,
            "quantization": dict(quantization) if quantization else None}  # fmt: skip


def adapter_record(adapter: LoRAAdapter) -> dict[str, Any]:
    scales = {module_weight_name(layer, module)[: -len(".weight")]: m.scale for (layer, module), m in sorted(adapter.modules.items())}
    return {
        "name": adapter.name,
        "version": adapter.version,
        "path": str(Path(adapter.path).resolve()),
        "r": adapter.r,
        "lora_alpha": adapter.lora_alpha,
        "use_rslora": adapter.use_rslora,
        "rank_pattern": dict(adapter.rank_pattern),
        "alpha_pattern": dict(adapter.alpha_pattern),
        "scales": scales,
    }


def merge_manifest(base: dict[str, Any], adapter: LoRAAdapter, output: dict[str, Any], verification: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "merge", "lorafleet_version": lorafleet_version(), "created_utc": utc_now(),
            "base": base, "adapter": adapter_record(adapter), "output": output, "verification": verification}  # fmt: skip


def quantize_manifest(base: dict[str, Any], output: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "quantize", "lorafleet_version": lorafleet_version(), "created_utc": utc_now(), "base": base, "output": output}


def folder_entries(folder: Path) -> list[str]:
    """Every file and folder under ``folder``, relative, folders ending in ``/``, sorted (symlinks are
    listed, not followed)."""
    entries = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder).as_posix()
        entries.append(rel + "/" if path.is_dir() and not path.is_symlink() else rel)
    return sorted(entries)


def write_manifest(out_dir: Path, filename: str, record: Mapping[str, Any]) -> Path:
    """Write ``record`` as ``out_dir / filename``, with ``files_written``: what ``out_dir`` holds besides it."""
    path = out_dir / filename
    written = [e for e in folder_entries(out_dir) if e != filename]
    path.write_text(json.dumps({**record, "files_written": written}, indent=2, sort_keys=False) + "\n")
    return path
