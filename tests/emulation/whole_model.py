"""Greedy generation over a mixed-adapter batch with ModelRunner on a given backend.

Shared by the emulated and the hardware Ascend tests: both compare the tokens with
the cpu backend's, which tests/test_peft_match.py checks against transformers + PEFT.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runtime.config import EngineConfig
from runtime.lora.adapter import load_adapter
from runtime.model_runner import ModelRunner, SeqStep

ORDER = ["a", "b", None, "c", "a", "d", None, "e"]  # None = base model
BLOCK, BLOCKS_PER_SEQ, PROMPT_LEN, NEW_TOKENS, MAX_RANK = 8, 6, 11, 16, 16


def greedy_tokens(model_dir: Path, adapters: dict[str, Path], device: str, backend: Any, dtype: str = "float32") -> torch.Tensor:
    """One prefill step, then NEW_TOKENS - 1 decode steps, argmax each time: [len(ORDER), NEW_TOKENS] (cpu)."""
    return greedy_trace(model_dir, adapters, device, backend, dtype)[0]


def greedy_trace(model_dir: Path, adapters: dict[str, Path], device: str, backend: Any, dtype: str = "float32",
                 forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``greedy_tokens`` and every step's float32 logits [len(ORDER), NEW_TOKENS, vocab] (cpu); with
    ``forced`` ([len(ORDER), NEW_TOKENS]) each step is fed those tokens instead of its own argmax."""
    config = EngineConfig(model=str(model_dir), device=device, dtype=dtype, max_loras=8, max_lora_rank=MAX_RANK,
                          num_kv_blocks=len(ORDER) * BLOCKS_PER_SEQ, block_size=BLOCK, max_num_batched_tokens=256)  # fmt: skip
    runner = ModelRunner(config, backend)
    slots = {}
    for slot, (name, path) in enumerate(sorted(adapters.items())):
        adapter = load_adapter(path, name, runner.lora_targets(), num_layers=runner.model_config.num_hidden_layers,
                               max_lora_rank=MAX_RANK)  # fmt: skip
        runner.write_adapter(slot, adapter, row_start=slot * MAX_RANK)
        slots[name] = slot
    lora = [slots[n] if n else -1 for n in ORDER]
    table = [list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i in range(len(ORDER))]
    prompts = torch.randint(0, 256, (len(ORDER), PROMPT_LEN), generator=torch.Generator().manual_seed(2))
    logits = runner.execute([SeqStep(prompts[i].tolist(), 0, table[i], lora[i]) for i in range(len(ORDER))])
    all_logits = [logits.float().cpu()]
    tokens = [logits.argmax(-1).cpu()]
    for step in range(NEW_TOKENS - 1):
        fed = forced[:, step] if forced is not None else tokens[-1]
        steps = [SeqStep([int(fed[i])], PROMPT_LEN + step, table[i], lora[i]) for i in range(len(ORDER))]
        logits = runner.execute(steps)
        all_logits.append(logits.float().cpu())
        tokens.append(logits.argmax(-1).cpu())
    return torch.stack(tokens, dim=1), torch.stack(all_logits, dim=1)
