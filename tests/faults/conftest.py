"""Fault-test helpers: an idle check over the engine snapshot, a loader we can hold, adapter copies."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.request import AdapterRef


def engine_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    values = dict(model=str(model_dir), device="cpu", dtype="float32", max_loras=2, max_lora_rank=16, max_cpu_loras=4,
                  max_num_seqs=16, max_model_len=96, block_size=8, num_kv_blocks=96, max_num_batched_tokens=64)
    values.update(overrides)
    return EngineConfig(**values)


def idle_problems(snap: dict[str, Any], registered: int | None = None) -> list[str]:
    """What keeps ``snap`` (an engine snapshot) from being idle; [] when idle.

    Idle: nothing running or waiting, every KV block free and unreferenced, no adapter
    demand or device refs, no adapter load in flight or queued, and (given ``registered``)
    no more host entries than registered adapters (a retired version was freed).
    """
    refs = snap["total_refcounts"]
    pool = snap["pool"]
    checks = {
        "running": snap["running"] == 0,
        "waiting": snap["waiting"] == 0,
        "kv free == total": snap["kv_blocks_free"] == snap["kv_blocks_total"],
        "kv refcount 0": snap["kv_block_refcount_total"] == 0,
        "adapter demand 0": refs["adapter_demand"] == 0,
        "adapter device refs 0": refs["adapter_device_refs"] == 0,
        "no load in flight": pool["loads_in_flight"] == 0 and pool["loads_queued"] == 0,
    }
    if registered is not None:
        checks["host entries <= registered"] = pool["host_entries"] <= registered
    return [name for name, ok in checks.items() if not ok]


class HeldLoadEngine(LLMEngine):
    """An LLMEngine whose disk loads (the pool's loader, run in its load thread) wait for ``load_gate``.

    The pool calls the engine's loader; overriding it here (dependency injection through
    the subclass, no patching) lets a test abort or unload while a load is in flight.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.load_gate = threading.Event()
        self.load_started = threading.Event()
        super().__init__(config)

    def _load_registered(self, ref: AdapterRef) -> Any:
        self.load_started.set()
        if not self.load_gate.wait(timeout=60):
            raise TimeoutError(f"test gate for loading {ref} was never opened")
        return super()._load_registered(ref)


@pytest.fixture
def adapter_copies(tiny_adapters: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    """Private copies of the standard adapters, free to delete or corrupt."""
    return {name: Path(shutil.copytree(path, tmp_path / "adapters" / name)) for name, path in tiny_adapters.items()}
