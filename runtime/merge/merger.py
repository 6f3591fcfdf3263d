"""Write a new HF checkpoint whose projection weights have one LoRA adapter baked in.

For every targeted module (layer l, module m) of the adapter, in float32:

    W'  = W + scale_{l,m} * B_{l,m} @ A_{l,m}          A [r, in], B [out, r], scale = alpha/r or alpha/sqrt(r)
    out = cast(W', dtype)

Every other tensor is copied, cast to ``dtype``. Tensors are written under their ``*ForCausalLM``
names (``causal_lm_names``: a base-model save's ``layers.0...`` becomes ``model.layers.0...``).
With an int8 weight-only base (``runtime/quant/int8.py``) a projection is first dequantized,
``W = q * s`` (codes and scales checked as serving checks them: int8 in -127..127, float32
finite and > 0), then merged in float, then either requantized (``quantize_output=True``: new codes and new
scales from ``W'``) or written as float. A float delta is never added to integer
codes: the codes' grid (the scale) would not move with the weights.

The same writer serves ``lorafleet quantize`` (no adapter, ``quantize_output=True``)
and the float copy of a quantized base that verification needs (no adapter,
``quantize_output=False``).

Output: ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json`` (HF's ``{"metadata": {"total_size"}, "weight_map"}``)
when the tensors exceed ``max_shard_bytes``. ``config.json`` is copied with the dtype
and ``quantization_config`` updated; ``generation_config.json`` and the tokenizer files
are copied unchanged. Tensors are read one at a time and each shard is saved once full,
so peak memory is one shard.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from runtime.file_mode import new_file_mode
from runtime.lora.adapter import LoRAAdapter
from runtime.models.loader import CheckpointError, causal_lm_names, check_quantized_tensor, checkpoint_quantization, weight_files
from runtime.progress_bar import ProgressBar
from runtime.quant.int8 import QUANTIZATION_CONFIG, dequantize_int8, is_quantized_projection, quantize_int8, scale_name

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # HF's default shard size
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


class MergeError(ValueError):
    """The merge cannot be done as asked; the message names the file, tensor or option."""


@dataclass(frozen=True)
class MergeSpec:
    """What to write: ``model_dir``'s weights, plus ``adapter`` (None = no delta), as ``dtype``.

    quantize_output: write the seven projections as int8 weight-only (codes + scales).
    """

    model_dir: Path
    adapter: LoRAAdapter | None
    dtype: torch.dtype
    quantize_output: bool
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES


@dataclass(frozen=True)
class WriteSummary:
    tensors_written: int
    modules_merged: int
    total_bytes: int
    files: tuple[str, ...]


def module_weight_name(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{_MODULE[module]}.{module}.weight"


def lora_delta(adapter: LoRAAdapter, layer: int, module: str) -> Tensor | None:
    """``scale * B @ A`` in float32, or None when the adapter does not target (layer, module)."""
    m = adapter.modules.get((layer, module))
    if m is None:
        return None
    return m.scale * (m.lora_b.float() @ m.lora_a.float())


def write_checkpoint(spec: MergeSpec, out_dir: Path, progress: bool = True) -> WriteSummary:
    """Write weights, config.json and side files of ``spec`` into the existing empty ``out_dir``."""
    files = weight_files(spec.model_dir)
    stored = causal_lm_names(files)
    source_quantized = checkpoint_quantization(spec.model_dir) is not None
    deltas = _delta_index(spec.adapter)
    names = [n for n in stored if not (source_quantized and _is_scale(n))]
    missing = [w for w in deltas if w not in stored]
    if missing:
        raise MergeError(f"{spec.model_dir}: the adapter targets {missing[0]}, which the checkpoint does not hold")
    shards = _ShardWriter(out_dir, spec.max_shard_bytes)
    merged = 0
    bar = ProgressBar(len(names), "merge" if spec.adapter else "write", "tensor", enabled=progress)
    for name, tensor in _read_float(files, stored, names, source_quantized):
        target = deltas.get(name)
        if target is not None and spec.adapter is not None:
            delta = lora_delta(spec.adapter, *target)
            if delta.shape != tensor.shape:  # never broadcast: a base checked against config.json cannot get here
                raise MergeError(f"{files[stored[name]]}: tensor {stored[name]} has shape {tuple(tensor.shape)}; the adapter's update is {tuple(delta.shape)}")
            tensor = tensor + delta  # float32 + float32; cast once, in _encode
            merged += 1
        for out_name, out_tensor in _encode(name, tensor, spec):
            shards.add(out_name, out_tensor)
        bar.update(1)
    bar.close()
    written = shards.finish()
    _write_config(spec, out_dir)
    _copy_side_files(spec.model_dir, out_dir)
    return WriteSummary(len(shards.weight_map), merged, shards.total_bytes, tuple(written))


def _is_scale(name: str) -> bool:
    return name.endswith("_scale") and is_quantized_projection(name[: -len("_scale")])


def _delta_index(adapter: LoRAAdapter | None) -> dict[str, tuple[int, str]]:
    """HF weight name -> (layer, module) the adapter targets; deltas are computed per tensor, one alive at a time."""
    if adapter is None:
        return {}
    return {module_weight_name(layer, module): (layer, module) for layer, module in adapter.modules}


def _read_float(files: dict[str, Path], stored: dict[str, str], names: list[str], quantized: bool) -> Iterator[tuple[str, Tensor]]:
    """Yield (name, float32 tensor) one at a time for ``names`` (``*ForCausalLM`` names; ``stored`` maps them
    to the checkpoint's, ``files`` those to their file); int8 projections are dequantized (q * s)."""
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[stored[n]], []).append(n)
    for path, group in by_file.items():
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as err:  # SafetensorError and friends: a truncated or garbled shard; name the file
            raise CheckpointError(f"{path}: not a readable safetensors file: {err}") from err
        with handle as f:
            for name in group:
                key = stored[name]
                try:
                    t = f.get_tensor(key)
                except Exception as err:  # SafetensorError: a shard that lacks a tensor its index names, or a truncated one
                    raise CheckpointError(f"{path}: cannot read tensor {key}: {err}") from err
                if quantized and is_quantized_projection(name):
                    s_name = scale_name(name)
                    if s_name not in stored:
                        raise CheckpointError(f"{path}: int8 tensor {key} has no scale tensor {scale_name(key)}")
                    check_quantized_tensor(name, t, path, stored_as=key)  # as serving: int8 codes in -127..127
                    s_key = stored[s_name]
                    with safe_open(str(files[s_key]), framework="pt", device="cpu") as fs:
                        scale = fs.get_tensor(s_key)
                    check_quantized_tensor(s_name, scale, files[s_key], stored_as=s_key)  # float32, finite, > 0
                    yield name, dequantize_int8(t, scale)
                elif not t.is_floating_point():
                    raise CheckpointError(f"{path}: tensor {key} is {t.dtype}; expected a float tensor")
                else:
                    yield name, t.float()


def _encode(name: str, tensor: Tensor, spec: MergeSpec) -> list[tuple[str, Tensor]]:
    if not torch.isfinite(tensor).all():
        raise MergeError(f"{spec.model_dir}: tensor {name} is not finite after merging (NaN or Inf)")
    if spec.quantize_output and is_quantized_projection(name):
        qw = quantize_int8(tensor)
        return [(name, qw.q), (scale_name(name), qw.scale)]
    out = tensor.to(spec.dtype).contiguous()
    if not torch.isfinite(out).all():  # e.g. a merged value beyond float16's 65504
        raise MergeError(f"{spec.model_dir}: tensor {name} does not fit {DTYPE_NAMES[spec.dtype]} after merging (values up to "
                         f"{float(tensor.abs().max()):.4g}); choose another --dtype")  # fmt: skip
    return [(name, out)]


def _save(shard: dict[str, Tensor], path: Path) -> None:
    """``save_file``, then the mode any new file gets under the umask (safetensors writes 0600,
    which would keep another account, e.g. the one running the server, from reading the weights)."""
    save_file(shard, str(path), metadata={"format": "pt"})
    os.chmod(path, new_file_mode())


class _ShardWriter:
    """Tensors in, shards out: a shard is saved as soon as the next tensor would take it past
    ``max_bytes``, so memory holds one shard. Shards are numbered as they are saved and renamed
    ``model-0000i-of-0000n.safetensors`` by ``finish`` (or ``model.safetensors`` when there is one),
    once ``n`` is known, together with the index."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        self.out_dir = out_dir
        self.max_bytes = max_bytes
        self.shard: dict[str, Tensor] = {}
        self.shard_bytes = 0
        self.total_bytes = 0
        self.saved: list[Path] = []
        self.weight_map: dict[str, int] = {}  # tensor name -> shard number, from 0

    def add(self, name: str, tensor: Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.shard and self.shard_bytes + size > self.max_bytes:
            self._save_shard()
        self.shard[name] = tensor
        self.weight_map[name] = len(self.saved)
        self.shard_bytes += size
        self.total_bytes += size

    def _save_shard(self) -> None:
        path = self.out_dir / f"model-{len(self.saved) + 1:05d}.safetensors.partial"
        _save(self.shard, path)
        self.saved.append(path)
        self.shard, self.shard_bytes = {}, 0

    def finish(self) -> list[str]:
        """Save the last shard, give every shard its final name, write the index; returns the file names."""
        self._save_shard()
        n = len(self.saved)
        names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        for path, name in zip(self.saved, names):
            os.rename(path, self.out_dir / name)
        if n == 1:
            return names
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": {k: names[i] for k, i in sorted(self.weight_map.items())}}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names + ["model.safetensors.index.json"]


def _write_config(spec: MergeSpec, out_dir: Path) -> None:
    src = spec.model_dir / "config.json"
    raw = json.loads(src.read_text())
    dtype_name = DTYPE_NAMES[spec.dtype]
    keys = [k for k in ("dtype", "torch_dtype") if k in raw] or ["torch_dtype"]  # transformers 5 writes "dtype", 4.x "torch_dtype"
    for key in keys:
        raw[key] = dtype_name
    if spec.quantize_output:
        raw["quantization_config"] = dict(QUANTIZATION_CONFIG)
    else:
        raw.pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def _copy_side_files(src: Path, out_dir: Path) -> None:
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out_dir / name)


def weights_sha256(model_dir: str | Path) -> str:
    """sha256 over the checkpoint's weight files (index + safetensors), in file-name order: the base's fingerprint."""
    root = Path(model_dir)
    paths = sorted({*weight_files(root).values()} | ({root / "model.safetensors.index.json"} if (root / "model.safetensors.index.json").is_file() else set()))
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
