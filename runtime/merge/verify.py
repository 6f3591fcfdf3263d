"""Compare a model's logits with a reference's on a fixed prompt set (teacher-forced greedy).

The reference (e.g. base + adapter through the dynamic LoRA path) decodes greedily for
``new_tokens`` steps from every prompt. Each candidate (e.g. the merged checkpoint) is
fed the *reference's* tokens, so both produce logits at exactly the same positions and
one early disagreement does not cascade. Over all ``P * new_tokens`` positions:

    max_abs    = max |logits_c - logits_ref|
    mean_abs   = mean |logits_c - logits_ref|
    agreement  = fraction of positions where argmax(logits_c) == the reference's greedy token

Everything runs through ``ModelRunner`` (paged KV, the backend's LoRA ops) in float32,
so a bf16/fp16 merged checkpoint is judged by the rounding of its stored weights only.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from backends import get_backend
from runtime.config import EngineConfig
from runtime.lora.adapter import LoRAAdapter
from runtime.model_runner import ModelRunner, SeqStep
from runtime.tokenizer import Tokenizer

# Fixed, varied prompts: prose, code, numbers, a list; byte-level tokenizers keep them short.
VERIFY_PROMPTS: tuple[str, ...] = (
    "The quick brown fox",
    "Once upon a time, in a",
    "def fibonacci(n):",
    "SELECT name FROM users WHERE",
    "1, 1, 2, 3, 5, 8,",
    "Dear team, the meeting",
    "In 1969 the first",
    "import torch\n",
)
DEFAULT_NEW_TOKENS = 16
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Trace:
    """tokens [P, N]: the token fed after each position (greedy or forced); logits [P, N, vocab] float32."""

    tokens: Tensor
    logits: Tensor


@dataclass(frozen=True)
class Figures:
    """Logit error of a candidate against the reference (see module docstring)."""

    max_abs: float
    mean_abs: float
    agreement: float
    positions: int

    @property
    def agreed(self) -> int:
        return round(self.agreement * self.positions)

    def as_dict(self) -> dict[str, float | int]:
        return {"max_abs_logit_diff": self.max_abs, "mean_abs_logit_diff": self.mean_abs,
                "greedy_agreement": self.agreement, "positions": self.positions}  # fmt: skip


def prompt_ids(model_dir: str | Path, prompts: Sequence[str] = VERIFY_PROMPTS) -> list[list[int]]:
    tok = Tokenizer(str(model_dir))
    return [tok.encode(p) for p in prompts]


def trace(
    model_dir: str | Path,
    adapter: LoRAAdapter | None,
    prompts: Sequence[Sequence[int]],
    new_tokens: int = DEFAULT_NEW_TOKENS,
    forced: Tensor | None = None,
    device: str = "cpu",
) -> Trace:
    """Prefill every prompt, then decode ``new_tokens - 1`` steps (all prompts batched in each step).

    The token after each position is ``forced[:, i]`` when given, else the argmax (greedy).
    """
    if new_tokens < 1:
        raise ValueError(f"new_tokens: must be >= 1, got {new_tokens}")
    n = len(prompts)
    longest = max(len(p) for p in prompts) + new_tokens
    blocks_per_seq = -(-longest // BLOCK_SIZE)
    rank = adapter.max_rank if adapter is not None else 1
    config = EngineConfig(
        model=str(model_dir), device=device, dtype="float32", max_loras=1, max_lora_rank=rank, max_cpu_loras=1,
        max_num_seqs=n, max_num_batched_tokens=max(sum(len(p) for p in prompts), n), max_model_len=longest,
        block_size=BLOCK_SIZE, num_kv_blocks=n * blocks_per_seq,
    )  # fmt: skip
    runner = ModelRunner(config, get_backend(device))
    slot = -1
    if adapter is not None:
        runner.write_adapter(0, adapter, row_start=0)
        slot = 0
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(n)]
    steps = [SeqStep(list(p), 0, tables[i], slot) for i, p in enumerate(prompts)]
    logits, tokens = [], []
    for i in range(new_tokens):
        out = runner.execute(steps)
        nxt = forced[:, i] if forced is not None else out.argmax(-1)
        logits.append(out)
        tokens.append(nxt)
        steps = [SeqStep([int(nxt[b])], len(prompts[b]) + i, tables[b], slot) for b in range(n)]
    del runner
    gc.collect()  # free the KV cache and weights before the next model is loaded
    return Trace(torch.stack(tokens, 1), torch.stack(logits, 1))


def compare(reference: Trace, candidate: Trace) -> Figures:
    """Figures of ``candidate`` (fed the reference's tokens) against ``reference``."""
    if reference.logits.shape != candidate.logits.shape:
        raise ValueError(f"compare: logits shapes differ: {tuple(reference.logits.shape)} vs {tuple(candidate.logits.shape)}")
    diff = (candidate.logits.double() - reference.logits.double()).abs()
    agree = (candidate.logits.argmax(-1) == reference.tokens).double()
    return Figures(float(diff.max()), float(diff.mean()), float(agree.mean()), int(agree.numel()))
