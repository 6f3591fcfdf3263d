"""Helpers for the engine tests: engines on the tiny llama, run-to-completion, adapter clones."""
from __future__ import annotations

import json
import random
import shutil
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file, save_file

from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.request import RequestOutput, SamplingParams


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    values = dict(
        model=str(model_dir), device="cpu", max_loras=2, max_lora_rank=16, max_cpu_loras=4,
        num_kv_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
    )
    values.update(overrides)
    return LLMEngine(EngineConfig(**values))


class StuckStepEngine(LLMEngine):
    """An LLMEngine whose steps wait for ``unstuck`` (a hung device, a deadlock); ``entered``: a step began."""

    def __init__(self, config: EngineConfig) -> None:
        self.entered, self.unstuck = threading.Event(), threading.Event()
        super().__init__(config)

    def step(self, wait_for_loads: bool = True) -> list[RequestOutput]:
        self.entered.set()
        self.unstuck.wait(60)
        return super().step(wait_for_loads)


class HeldReadEngine(LLMEngine):
    """An LLMEngine whose adapter file reads wait for ``read_gate`` (a stuck network mount) before
    they read; ``reading``: a read began."""

    def __init__(self, config: EngineConfig) -> None:
        self.reading, self.read_gate = threading.Event(), threading.Event()
        super().__init__(config)

    def load_adapter_files(self, name: str, path: str, *, within=None):  # type: ignore[no-untyped-def]
        self.reading.set()
        self.read_gate.wait(60)
        return super().load_adapter_files(name, path, within=within)


class HeldLoadEngine(LLMEngine):
    """An LLMEngine whose adapter pool's disk reads (a request whose adapter is not on the host
    tier) wait for ``load_gate`` (a stuck network mount) before they read; ``loading``: one began."""

    def __init__(self, config: EngineConfig) -> None:
        self.loading, self.load_gate = threading.Event(), threading.Event()
        super().__init__(config)

    def _load_registered(self, ref):  # type: ignore[no-untyped-def]
        self.loading.set()
        self.load_gate.wait(60)
        return super()._load_registered(ref)


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("engine did not finish within max_steps")


def run_alone(engine: LLMEngine, request_id: str, prompt, params: SamplingParams, adapter: Optional[str]) -> RequestOutput:
    engine.add_request(request_id, prompt, params, adapter)
    return run_to_completion(engine)[request_id]


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(length)]


def clone_adapter(src: Path, dst: Path, seed: int, r: Optional[int] = None) -> Path:
    """A new PEFT adapter folder with ``src``'s config/targets and fresh random weights (rank ``r`` if given)."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    rank = r if r is not None else config["r"]
    out = {}
    for key, t in tensors.items():
        if "lora_A" in key:
            shape = (rank, t.shape[1])
        else:
            shape = (t.shape[0], rank)
        out[key] = (torch.randn(shape, generator=gen) * 0.3).contiguous()
    config.update(r=rank, lora_alpha=2 * rank, rank_pattern={}, alpha_pattern={})
    (dst / "adapter_config.json").write_text(json.dumps(config))
    save_file(out, str(dst / "adapter_model.safetensors"))
    return dst


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst
