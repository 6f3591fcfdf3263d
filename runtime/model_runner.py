"""ModelRunner: the model, its tokenizer, the paged KV cache and the LoRA slice buffers on one backend.

One ``execute(steps)`` call runs one engine step: the new tokens of several
sequences (prefill chunks and/or single decode tokens) concatenated into ``T`` rows.
It builds the step's ``AttentionMeta`` and ``LoRABatchMeta`` once, runs the decoder,
and returns float32 logits for the last row of every step with ``sample=True``, and for every
row of a step with ``score_all=True`` (prompt logprobs).

KV cache: per layer ``[2, num_kv_blocks * block_size, Hkv, D]`` in the model dtype.
With ``num_kv_blocks=None`` the pool holds ``max_num_seqs`` sequences of
``max_model_len`` tokens, capped by ``kv_cache_mb``.

LoRA: every layer's q/k/v/o/gate/up/down slice owns a ``LoRASliceWeights`` with
``max_loras`` slots and ``pool_rows`` rows. ``write_adapter(slot, adapter, row_start)``
writes each slice's own rank at ``row_start`` (rank 0 where the adapter does not
target the slice). The float32 shrink workspace is ``[3, max_num_batched_tokens, max_lora_rank]``.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from runtime.capabilities import require
from runtime.config import ConfigError, EngineConfig
from runtime.kv.attention_meta import AttentionMeta
from runtime.lora.adapter import LoRAAdapter
from runtime.lora.batch_meta import NO_ADAPTER, LoRABatchMeta, adapter_order
from runtime.models.hf_config import load_model_config
from runtime.models.llama import LlamaModel, LoRAPoolShape, StepContext, lora_targets
from runtime.models.loader import checkpoint_quantization, load_weights, torch_dtype
from runtime.tokenizer import Tokenizer

MAX_SLICES_PER_PROJECTION = 3  # q/k/v


@dataclass(frozen=True)
class SeqStep:
    """One sequence's share of a step.

    token_ids:   this step's new tokens (a prefill chunk, or one decode token)
    start_pos:   position of token_ids[0]; KV of positions < start_pos is already in block_table's blocks
    block_table: KV block ids of the sequence, covering positions 0 .. start_pos + len(token_ids) - 1
    lora_slot:   device adapter slot, or -1 for the base model
    sample:      return logits for the last token of this step
    score_all:   return logits for every token of this step (the last one included, once)
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    lora_slot: int = NO_ADAPTER
    sample: bool = True
    score_all: bool = False

    @property
    def logit_rows(self) -> int:
        """Rows of ``ModelRunner.execute``'s result that belong to this step."""
        return len(self.token_ids) if self.score_all else int(self.sample)

    def __post_init__(self) -> None:
        if len(self.token_ids) == 0:
            raise ValueError("SeqStep.token_ids: a step needs at least one token")
        if self.start_pos < 0:
            raise ValueError(f"SeqStep.start_pos: must be >= 0, got {self.start_pos}")
        if self.lora_slot < NO_ADAPTER:
            raise ValueError(f"SeqStep.lora_slot: must be >= 0 or -1, got {self.lora_slot}")

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


def host_memory_available() -> int | None:
    """Bytes the kernel says a new allocation can get without swapping (Linux ``MemAvailable``),
    else the machine's physical memory; None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


@contextmanager
def _allocating(what: str, device: torch.device, lower: str, nbytes: int | None = None) -> Iterator[None]:
    """Turn an allocation failure (torch's out-of-memory error, or the CPU allocator's
    "can't allocate memory") into a ConfigError that names the setting to lower. On the CPU,
    ``nbytes`` beyond the memory available is refused before allocating: Linux lets such an
    allocation succeed, then kills the process while the zeros are written."""
    if nbytes is not None and device.type == "cpu":
        available = host_memory_available()
        if available is not None and nbytes > available:
            raise ConfigError(f"{what} needs {nbytes / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB of memory available "
                              f"here; lower {lower}")
    try:
        yield
    except RuntimeError as err:  # torch.OutOfMemoryError is one
        if not isinstance(err, torch.OutOfMemoryError) and "allocate" not in str(err):
            raise
        text = str(err).strip()
        detail = text.splitlines()[0] if text else type(err).__name__  # CUDA's first line says how much it tried
        raise ConfigError(f"{what} does not fit in {device} memory ({detail}); lower {lower}") from None


def check_cpu_gemm_applies(config: EngineConfig, asked: str) -> None:
    """Refuse an explicit ``cpu_gemm`` (``asked``, before ``for_backend`` resolved auto) that would change
    nothing for this checkpoint: an int8 one (``lorafleet quantize``) runs its projections int8 whatever
    the choice, so only an untied LM head is left for it to choose the kernel of; with the head tied to
    the embedding no float32 GEMM is left at all. Reads config.json only, before any weight is loaded."""
    if asked == "auto" or checkpoint_quantization(config.model) is None or not load_model_config(config.model).tie_word_embeddings:
        return
    raise ConfigError(f"cpu_gemm: {asked!r} chooses the float32 GEMM; this int8 checkpoint runs its projections int8 and its LM head "
                      "is tied to the embedding (tie_word_embeddings), so it would change nothing: leave it at auto")


class ModelRunner:
    def __init__(self, config: EngineConfig, backend: Any) -> None:
        config = config.for_backend(backend.name)
        self.config = config
        self.backend = backend
        self.device = torch.device(backend.device)
        self.dtype = torch_dtype(config.dtype)
        self.model_config = load_model_config(config.model)
        if checkpoint_quantization(config.model) is not None:
            require("quantized_base_int8", backend.name)  # refuse, quoting the matrix, where it is undeclared
        mc = self.model_config
        self.max_model_len = self._max_model_len()
        self.tokenizer = Tokenizer(config.model)
        self.block_size = config.block_size
        # Sized from config.json alone, before the weights load: a pool that cannot hold one
        # sequence of max_model_len is refused at once, not after minutes of reading a checkpoint.
        self.num_kv_blocks = self._num_kv_blocks()
        weights = load_weights(mc, config.model, self.dtype, self.device)
        pool = LoRAPoolShape(
            max_slots=config.max_loras, row_capacity=config.pool_rows, interleaved_a=bool(getattr(backend.lora, "interleaved_a", False))
        )
        # Building the model joins the base's q/k/v and gate/up weights and allocates the adapter pool.
        pool_bytes = config.pool_rows * sum(i + o for i, o in lora_targets(mc).values()) * mc.num_hidden_layers * self.dtype.itemsize
        with _allocating(f"lora_pool_rows: the model (its weights and an adapter pool of {config.pool_rows} rank-rows per target "
                         f"slice x {config.max_loras} slots)", self.device, "--lora-pool-rows or --max-loras / --max-lora-rank, or use a "
                         "smaller --dtype", pool_bytes):  # fmt: skip
            self.model = LlamaModel(mc, weights, pool, self.max_model_len, cpu_gemm=config.cpu_gemm)
        del weights
        cache_rows = self.num_kv_blocks * self.block_size
        kv_gib = self.num_kv_blocks * self.kv_bytes_per_block() / 2**30
        with _allocating(f"num_kv_blocks: the KV cache ({self.num_kv_blocks} blocks, {kv_gib:.1f} GiB)", self.device, "--num-kv-blocks or --kv-cache-mb",
                         self.num_kv_blocks * self.kv_bytes_per_block()):  # fmt: skip
            self.kv_caches = [
                torch.zeros(2, cache_rows, mc.num_key_value_heads, mc.head_dim, dtype=self.dtype, device=self.device)
                for _ in range(mc.num_hidden_layers)
            ]
        self.workspace = torch.zeros(
            MAX_SLICES_PER_PROJECTION, config.max_num_batched_tokens, config.max_lora_rank, dtype=torch.float32, device=self.device
        )

    # ---- sizing -------------------------------------------------------------------------

    def _max_model_len(self) -> int:
        limit = self.model_config.max_model_len
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            why = ("the sliding window (config.json's sliding_window, or transformers' default 4096 when the key is absent)"
                   if self.model_config.sliding_window == limit else "max_position_embeddings in config.json")
            raise ConfigError(f"max_model_len: {wanted} exceeds the model's limit {limit} ({why}, {self.model_config.path})")
        return wanted

    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        per_token = 2 * mc.num_key_value_heads * mc.head_dim * torch.tensor([], dtype=self.dtype).element_size()
        return per_token * self.block_size * mc.num_hidden_layers

    def _num_kv_blocks(self) -> int:
        """``num_kv_blocks`` as given, else ``min(max_num_seqs * ceil(max_model_len / B), kv_cache_mb MiB //
        kv_bytes_per_block())``; refused when the cap holds fewer blocks than one max_model_len sequence."""
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        wanted = self.config.max_num_seqs * blocks_per_seq
        per_block = self.kv_bytes_per_block()
        cap = (self.config.kv_cache_cap_mb << 20) // per_block
        if cap < blocks_per_seq:
            given = "" if self.config.kv_cache_mb is not None else " (the default)"
            origin = "" if self.config.max_model_len is not None else " (the model's limit)"
            need_mb = -(-blocks_per_seq * per_block // (1 << 20))
            raise ConfigError(
                f"kv_cache_mb: {self.config.kv_cache_cap_mb} MiB{given} holds {cap} KV blocks ({cap * self.block_size} tokens), "
                f"fewer than one sequence of max_model_len={self.max_model_len}{origin} needs ({blocks_per_seq} blocks); "
                f"raise --kv-cache-mb to at least {need_mb} or lower --max-model-len to at most {cap * self.block_size}"
            )
        return min(wanted, cap)

    # ---- LoRA slots ---------------------------------------------------------------------

    def lora_targets(self) -> dict[str, tuple[int, int]]:
        """HF module name -> (in_features, out_features); what adapters are validated against."""
        return lora_targets(self.model_config)

    def write_adapter(self, slot: int, adapter: LoRAAdapter, row_start: int) -> None:
        """Copy ``adapter`` into device ``slot`` at rows ``row_start ..`` of every slice it targets."""
        self._check_slot(slot)
        if adapter.max_rank > self.config.max_lora_rank:
            raise ValueError(f"adapter {adapter.name}: rank {adapter.max_rank} exceeds max_lora_rank={self.config.max_lora_rank}")
        unknown = [key for key in adapter.modules if not (0 <= key[0] < len(self.model.layers)) or key[1] not in self.lora_targets()]
        if unknown:
            raise ValueError(f"adapter {adapter.name}: modules {unknown[:4]} do not exist in this model")
        for layer, name, weights in self.model.all_slices():
            module = adapter.modules.get((layer, name))
            if module is None:
                weights.clear_slot(slot)
            else:
                weights.write_slot(slot, row_start, module.lora_a.to(self.dtype), module.lora_b.to(self.dtype), module.scale)

    def clear_slot(self, slot: int) -> None:
        self._check_slot(slot)
        for _, _, weights in self.model.all_slices():
            weights.clear_slot(slot)

    def _check_slot(self, slot: int) -> None:
        self._require_model()
        if not 0 <= slot < self.config.max_loras:
            raise ValueError(f"slot {slot} is out of range 0..{self.config.max_loras - 1} (max_loras)")

    # ---- forward ------------------------------------------------------------------------

    def release(self) -> None:
        """Drop the model weights, KV cache, LoRA buffers and workspace (idempotent). The
        runner is unusable afterwards: ``execute`` and ``memory_report`` raise."""
        self.model = None
        self.kv_caches = []
        self.workspace = None

    def _require_model(self) -> None:
        if self.model is None:
            raise RuntimeError("ModelRunner: released (its engine was closed); create a new engine")

    @torch.inference_mode()
    def execute(self, steps: Sequence[SeqStep]) -> Tensor:
        """Run one step; float32 logits [sum of ``logit_rows``, vocab], step by step in the callers'
        order: every token of a ``score_all`` step, else the last token of a ``sample`` step."""
        self._require_model()
        if not steps:
            raise ValueError("execute: no steps")
        tokens: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        vocab = self.model_config.vocab_size
        for i, step in enumerate(steps):
            if step.end_pos > self.max_model_len:
                raise ValueError(f"steps[{i}]: positions up to {step.end_pos - 1} exceed max_model_len={self.max_model_len}")
            if step.lora_slot >= self.config.max_loras:
                raise ValueError(f"steps[{i}]: lora_slot {step.lora_slot} is out of range (max_loras={self.config.max_loras})")
            bad = [t for t in step.token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"steps[{i}]: token ids {bad[:4]} are outside the vocabulary (size {vocab})")
        # Sequences run grouped by adapter slot (base-model rows last), so every LoRA
        # segment is a contiguous row range (``LoRABatchMeta.first_row``); logits still
        # come back in the callers' order.
        caller_index = adapter_order([s.lora_slot for s in steps])
        rows_of: dict[int, range] = {}  # caller index -> its rows of the hidden states
        for i in caller_index:
            step = steps[i]
            first = len(tokens)
            tokens.extend(step.token_ids)
            positions.extend(range(step.start_pos, step.end_pos))
            token_slots.extend([step.lora_slot] * len(step.token_ids))
            rows_of[i] = range(len(tokens) - step.logit_rows, len(tokens)) if step.logit_rows else range(first, first)
        if len(tokens) > self.workspace.shape[1]:
            raise ValueError(f"execute: {len(tokens)} tokens exceed max_num_batched_tokens={self.config.max_num_batched_tokens}")
        decode_only = all(len(s.token_ids) == 1 for s in steps)
        ordered = [steps[i] for i in caller_index]
        attn_meta = AttentionMeta.build(
            [len(s.token_ids) for s in ordered],
            [s.end_pos for s in ordered],
            [list(s.block_table) for s in ordered],
            self.block_size,
            self.device,
        )
        for i, step in enumerate(steps):
            too_big = [b for b in step.block_table if not 0 <= b < self.num_kv_blocks]
            if too_big:
                raise ValueError(f"steps[{i}]: block ids {too_big[:4]} are outside the KV pool (num_kv_blocks={self.num_kv_blocks})")
        lora_meta = LoRABatchMeta.build(token_slots, self.device, decode_only=decode_only)
        ctx = StepContext(attn_meta, lora_meta, self.backend.lora, self.backend.attention, self.workspace)
        ids = torch.tensor(tokens, dtype=torch.int64).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        hidden = self.model.forward(ids, pos, self.kv_caches, ctx)
        logit_rows = [row for i in range(len(steps)) for row in rows_of[i]]
        rows = torch.tensor(logit_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model.logits(hidden.index_select(0, rows))

    def memory_report(self) -> dict[str, int]:
        """Bytes held on the device: base weights, KV cache, LoRA slice buffers, shrink workspace,
        and what the backend's LoRA ops keep derived from the slice buffers right now
        (``lora_copies_bytes``: the CPU backend's float32 copies of a bf16/fp16 pool's slots in
        use; a write to the pool makes the copies of the slots whose rows it wrote stale, and the next LoRA call on that
        projection drops them; 0 where the ops keep none)."""
        self._require_model()
        slices = [w for _, _, w in self.model.all_slices()]
        lora = sum(t.numel() * t.element_size() for w in slices for t in (w.a_rows, w.b_rows, w.slot_start, w.slot_rank, w.slot_scale))
        copied = getattr(self.backend.lora, "copied_bytes", None)
        return {
            "weights_bytes": self.model.weight_bytes(),
            "kv_cache_bytes": sum(c.numel() * c.element_size() for c in self.kv_caches),
            "lora_pool_bytes": lora,
            "lora_copies_bytes": int(copied(slices)) if copied is not None else 0,
            "workspace_bytes": self.workspace.numel() * self.workspace.element_size(),
        }
