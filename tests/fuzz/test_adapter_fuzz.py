"""Hypothesis fuzz of the PEFT adapter reader: random corruptions of a valid adapter folder.

Corruptions: truncated files, flipped bytes, wrong dtypes, edited shapes, edited
safetensors header entries, config JSON edits (changed, removed or wrongly-typed fields),
extra, missing or renamed tensors, files deleted or replaced by folders.

Every outcome is either a valid adapter (some edits keep it valid: other finite weights,
another valid alpha) or an ``AdapterError`` (a ValueError) whose message names the
folder's file; never another exception type. Registration through a real engine is all
or nothing: after a failure ``adapters()`` and the adapter pool are unchanged.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from runtime.engine import LLMEngine
from runtime.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterError
from tests.faults.conftest import engine_config

CONFIG_KEYS = ("r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "use_rslora", "peft_type",
               "layers_to_transform", "bias", "use_dora", "exclude_modules", "modules_to_save", "layers_pattern", "fan_in_fan_out")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=8,
)
header_values = json_values | st.sampled_from(["F32", "F16", "BF16", "F64", "I32", "I8", "U8", "BOOL", "F8_E4M3"]) \
    | st.lists(st.integers(-3, 10**6), min_size=0, max_size=4)
DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int8, torch.uint8, torch.bool]


def _read_header(blob: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _write_header(path: Path, header: dict[str, Any], data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@st.composite
def corruption(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from([
        "truncate-weights", "truncate-config", "flip-bytes", "config-set", "config-delete", "config-garbage",
        "dtype", "shape", "extra-tensor", "missing-tensor", "rename-tensor", "header-entry", "header-length",
        "delete-file", "file-is-folder",
    ]))
    return kind, draw(st.data())


def corrupt(folder: Path, kind: str, data: st.DataObject) -> None:
    weights, config = folder / WEIGHTS_FILE, folder / CONFIG_FILE
    blob = weights.read_bytes()
    if kind == "truncate-weights":
        weights.write_bytes(blob[: data.draw(st.integers(0, len(blob) - 1))])
    elif kind == "truncate-config":
        text = config.read_bytes()
        config.write_bytes(text[: data.draw(st.integers(0, len(text) - 1))])
    elif kind == "flip-bytes":
        b = bytearray(blob)
        for i in data.draw(st.lists(st.integers(0, len(b) - 1), min_size=1, max_size=8)):
            b[i] ^= data.draw(st.integers(1, 255))
        weights.write_bytes(bytes(b))
    elif kind in ("config-set", "config-delete", "config-garbage"):
        cfg = json.loads(config.read_text())
        key = data.draw(st.sampled_from(CONFIG_KEYS))
        if kind == "config-set":
            cfg[key] = data.draw(json_values)
            config.write_text(json.dumps(cfg))
        elif kind == "config-delete":
            cfg.pop(key, None)
            config.write_text(json.dumps(cfg))
        else:
            config.write_bytes(data.draw(st.binary(max_size=64)))
    elif kind in ("dtype", "shape", "extra-tensor", "missing-tensor", "rename-tensor"):
        tensors = load_file(str(weights))
        name = data.draw(st.sampled_from(sorted(tensors)))
        t = tensors[name]
        if kind == "dtype":
            tensors[name] = t.to(data.draw(st.sampled_from(DTYPES)))
        elif kind == "shape":
            dim = data.draw(st.integers(0, t.dim() - 1))
            new = list(t.shape)
            new[dim] = data.draw(st.integers(0, t.shape[dim] + 3).filter(lambda v: v != t.shape[dim]))
            tensors[name] = torch.randn(new) if all(new) else torch.empty(new)
        elif kind == "extra-tensor":
            tensors[name.replace("lora_A", "lora_C") + data.draw(st.sampled_from(["", ".x"]))] = torch.randn(2, 2)
        elif kind == "missing-tensor":
            del tensors[name]
        else:
            tensors[name.replace(".layers.", ".layer.", 1)] = tensors.pop(name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights))
    elif kind == "header-entry":
        header, rest = _read_header(blob)
        name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        if data.draw(st.booleans()):
            header[name][field] = data.draw(header_values)
        else:
            header[name] = data.draw(json_values)
        _write_header(weights, header, rest)
    elif kind == "header-length":
        weights.write_bytes(struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1))) + blob[8:])
    elif kind == "delete-file":
        data.draw(st.sampled_from([weights, config])).unlink()
    elif kind == "file-is-folder":
        target = data.draw(st.sampled_from([weights, config]))
        target.unlink()
        target.mkdir()


@pytest.fixture(scope="module")
def fuzz_engine(tiny_llama_dir: Path, tiny_adapters: dict[str, Path]):
    engine = LLMEngine(engine_config(tiny_llama_dir, max_lora_rank=16, max_cpu_loras=4))
    engine.register_adapter("resident", str(tiny_adapters["a"]))
    yield engine
    engine.close()


@given(case=corruption(), source=st.sampled_from(["a", "e"]))
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_corrupted_adapter_is_a_clear_error_or_valid(case, source: str, fuzz_engine, tiny_adapters: dict[str, Path], tmp_path_factory) -> None:
    kind, data = case
    folder = Path(shutil.copytree(tiny_adapters[source], tmp_path_factory.mktemp("fuzz") / "adapter"))
    corrupt(folder, kind, data)
    before = [(a.name, a.version) for a in fuzz_engine.adapters()]
    pool_before = fuzz_engine.pool.host_refs()
    try:
        ref = fuzz_engine.register_adapter("fuzzed", str(folder))
    except AdapterError as err:
        event(f"{kind}: AdapterError")
        assert str(folder) in str(err), f"{kind}: the message does not name the adapter's file: {err}"
        assert [(a.name, a.version) for a in fuzz_engine.adapters()] == before  # nothing half-registered
        assert fuzz_engine.pool.host_refs() == pool_before
        return
    event(f"{kind}: still valid")
    # Still a valid adapter (e.g. other finite weights): it registered fully; undo it.
    assert ref.name == "fuzzed" and any(a.name == "fuzzed" for a in fuzz_engine.adapters())
    fuzz_engine.unregister_adapter("fuzzed")
    assert [(a.name, a.version) for a in fuzz_engine.adapters()] == before
