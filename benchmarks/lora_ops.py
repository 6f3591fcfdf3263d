"""LoRA op benchmark: grouped shrink/expand vs a per-request loop and vs padded gather+bmm,
and the LoRA tax on a decode step.

    python benchmarks/lora_ops.py --device cpu|cuda|npu [--json OUT]

Cases (side by side, one run):

- ``decode``: 64 rows (one token each), 8 adapters with ranks {8, 16, 32, 64} (two each),
  rows of each adapter scattered through the batch, q/k/v-like slices (hidden -> hidden,
  hidden/4, hidden/4) in one op; hidden 1024 on cpu, 4096 on cuda/npu.
- ``decode32`` (cuda/npu): the same with 32 distinct adapters.
- ``prefill``: 4 sequences of 128 tokens (cpu) / 8 of 256 (gpu), 4 adapters, passed in an
  order that is not the slot order, so ``segment`` (as passed) and ``engine order`` differ.

Each case times three implementations of ``y += LoRA(x)`` (shrink then expand, all slices):

- ``grouped``: the backend's ops (``apply_lora``), i.e. what the engine runs;
- ``loop``: one ``x[t] @ A^T @ B^T`` per request row, per slice (no grouping);
- ``padded``: every adapter stored padded to the max rank, ``A_pad[slot]`` gathered per row,
  two ``bmm`` (vLLM-style padding; padding built once, outside the timing).

LoRA tax: a stack of decoder-layer-like base GEMMs (fused qkv, o, fused gate/up, down)
at decode batch 64, with and without LoRA on all seven slices at rank 16 (8 adapters,
mixed rows): ``tax = t_lora / t_base - 1``. On cuda the script also measures ceilings in
the same run (device-to-device copy GB/s, bf16 matmul TFLOP/s), reports shrink/expand
achieved GB/s and TFLOP/s against them, and the tax on whole decode steps of a
1B-class random-weight Llama with 32 adapters through ``ModelRunner``.

Timing: CPU uses ``time.perf_counter`` with warm-up and the median of repeats; GPUs use
CUDA events around repeated launches after warm-up (``torch.cuda.synchronize``).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO))

from backends import BackendUnavailable, get_backend  # noqa: E402
from runtime.backend_api import apply_lora  # noqa: E402
from runtime.lora.batch_meta import LoRABatchMeta, adapter_order  # noqa: E402
from runtime.lora.slice_weights import LoRASliceWeights  # noqa: E402

DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16, "npu": torch.float16}


# ---------------------------------------------------------------------------- timing

@dataclass(frozen=True)
class Timer:
    """Median wall time of ``fn`` on one device (seconds)."""

    device: torch.device
    warmup: int = 2
    repeats: int = 9

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type == "cuda":
            return self._cuda(fn)
        samples = []
        for _ in range(self.repeats):
            self._sync()
            start = time.perf_counter()
            fn()
            self._sync()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def paired(self, fns: Sequence[Callable[[], object]], rounds: int = 5) -> list[float]:
        """Median time of each fn, measured in alternating rounds (A B C, A B C, ...).

        On a shared machine the load drifts; interleaving exposes every fn to the same
        drift, so their ratio is meaningful even when absolute times are not.
        """
        per_fn: list[list[float]] = [[] for _ in fns]
        for _ in range(rounds):
            for i, fn in enumerate(fns):
                per_fn[i].append(self(fn))
        return [statistics.median(v) for v in per_fn]

    def tax(self, base_fn: Callable[[], object], lora_fn: Callable[[], object], pairs: int = 41) -> tuple[float, float, float]:
        """(base seconds, LoRA seconds, LoRA time / base time - 1).

        On host-timed devices the two run back to back, ``pairs`` times, alternating
        which goes first, and the tax is the median of the per-pair ratios: on a noisy
        shared machine, neighbouring calls see the same load, whole rounds do not. CUDA
        times each with events in alternating rounds (``paired``)."""
        if self.device.type == "cuda":
            base, lora = self.paired([base_fn, lora_fn], rounds=3)
            return base, lora, lora / base - 1.0
        for _ in range(self.warmup):
            base_fn()
            lora_fn()
        base_t, lora_t = [], []
        for i in range(pairs):
            for fn, samples in ((base_fn, base_t), (lora_fn, lora_t))[:: 1 if i % 2 == 0 else -1]:
                self._sync()
                start = time.perf_counter()
                fn()
                self._sync()
                samples.append(time.perf_counter() - start)
        ratio = statistics.median(lo / ba for ba, lo in zip(base_t, lora_t))
        return statistics.median(base_t), statistics.median(lora_t), ratio - 1.0

    def _cuda(self, fn: Callable[[], object]) -> float:
        inner = 10  # launches per event pair, so event resolution does not dominate
        samples = []
        for _ in range(self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        return statistics.median(samples)

    def _sync(self) -> None:
        if self.device.type == "npu":
            torch.npu.synchronize()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- problems

@dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    slice_outs: tuple[int, ...]
    rows_per_seq: int
    seq_slots: tuple[int, ...]  # adapter slot of each sequence (-1 = base)
    adapter_ranks: tuple[int, ...]  # rank of each slot

    @property
    def decode(self) -> bool:
        return self.rows_per_seq == 1

    def token_slots(self) -> list[int]:
        return [s for s in self.seq_slots for _ in range(self.rows_per_seq)]


def scattered(n_rows: int, n_adapters: int, seed: int) -> tuple[int, ...]:
    """Every adapter gets n_rows / n_adapters rows, in random order (not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    slots = [i % n_adapters for i in range(n_rows)]
    return tuple(slots[i] for i in torch.randperm(n_rows, generator=gen).tolist())


def cases(device: str) -> list[Case]:
    gpu = device != "cpu"
    hidden = 4096 if gpu else 1024
    outs = (hidden, hidden // 4, hidden // 4)
    ranks8 = (8, 16, 32, 64) * 2
    result = [Case("decode", hidden, outs, 1, scattered(64, 8, 0), ranks8)]
    if gpu:
        result.append(Case("decode32", hidden, outs, 1, scattered(64, 32, 1), tuple(ranks8[i % 8] for i in range(32))))
        result.append(Case("prefill", hidden, outs, 256, (0, 1, 2, 3, 0, 1, 2, 3), (8, 16, 32, 64)))
    else:
        result.append(Case("prefill", hidden, outs, 128, (2, 0, 3, 1), (8, 16, 32, 64)))  # not in slot order
    return result


def make_weights(in_features: int, outs: Sequence[int], ranks: Sequence[int], dtype: torch.dtype, device: torch.device, seed: int,
                 interleaved: bool = False) -> list[LoRASliceWeights]:  # fmt: skip
    """One slice per out width; slot s has rank ranks[s] at its own row range (unpadded).
    ``interleaved``: the slices' A rows share one buffer (the B rows too when the slices have
    one width), as the model allocates them for ops that ask for it (``interleaved_a``)."""
    gen = torch.Generator().manual_seed(seed)
    allocated = LoRASliceWeights.allocate_projection(in_features, list(outs), len(ranks), sum(ranks), dtype, device, interleaved)
    slices = []
    for out_features, w in zip(outs, allocated):
        row = 0
        for slot, r in enumerate(ranks):
            a = torch.randn(r, in_features, generator=gen) / math.sqrt(in_features)
            b = torch.randn(out_features, r, generator=gen) / math.sqrt(r)
            w.write_slot(slot, row, a.to(dtype), b.to(dtype), 2.0)
            row += r
        slices.append(w)
    return slices


class Padded:
    """vLLM-style storage: every adapter padded to the max rank, gathered per row."""

    def __init__(self, weights: Sequence[LoRASliceWeights]) -> None:
        pad = max(w.max_rank for w in weights)
        self.a, self.b, self.scale = [], [], []
        for w in weights:
            a = torch.zeros(w.max_slots, pad, w.in_features, dtype=w.a_rows.dtype, device=w.a_rows.device)
            b = torch.zeros(w.max_slots, pad, w.out_features, dtype=w.b_rows.dtype, device=w.b_rows.device)
            for s, (start, r) in enumerate(zip(w.host_start, w.host_rank)):
                a[s, :r] = w.a_rows[start : start + r]
                b[s, :r] = w.b_rows[start : start + r]
            self.a.append(a)
            self.b.append(b)
            self.scale.append(w.slot_scale)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, offsets: Sequence[int]) -> None:
        idx = slots.clamp(min=0).long()
        keep = (slots >= 0).to(y.dtype)[:, None]
        for a, b, scale, off in zip(self.a, self.b, self.scale, offsets):
            h = torch.bmm(a[idx], x[:, :, None])  # [T, R, 1]
            delta = torch.bmm(h.transpose(1, 2), b[idx])[:, 0, :]  # [T, out]
            y[:, off : off + b.shape[2]] += delta * (scale[idx].to(y.dtype)[:, None] * keep)


def per_request_loop(
    x: torch.Tensor, y: torch.Tensor, weights: Sequence[LoRASliceWeights], seq_slots: Sequence[int], rows_per_seq: int, offsets: Sequence[int]
) -> None:
    """No grouping across requests: each request applies its own adapter to its own rows
    (one row in decode, its whole chunk in prefill) with its own small matmuls."""
    for i, slot in enumerate(seq_slots):
        if slot < 0:
            continue
        lo, hi = i * rows_per_seq, (i + 1) * rows_per_seq
        for w, off in zip(weights, offsets):
            r, start = w.host_rank[slot], w.host_start[slot]
            if r:
                h = x[lo:hi] @ w.a_rows[start : start + r].t()
                y[lo:hi, off : off + w.out_features] += w.host_scale[slot] * (h @ w.b_rows[start : start + r])


def op_bytes_flops(case: Case, weights: Sequence[LoRASliceWeights], dtype: torch.dtype) -> dict[str, float]:
    """Minimum bytes and FLOPs of shrink and expand (each distinct adapter's weights read once)."""
    el, t = torch.tensor([], dtype=dtype).element_size(), len(case.token_slots())
    used = sorted({s for s in case.seq_slots if s >= 0})
    rows = case.token_slots()
    shrink_b = t * case.hidden * el
    expand_b = 0.0
    flops_s = flops_e = 0.0
    for w in weights:
        r_sum = sum(w.host_rank[s] for s in used)
        shrink_b += r_sum * case.hidden * el + sum(w.host_rank[s] for s in rows if s >= 0) * 4
        expand_b += r_sum * w.out_features * el + sum(w.host_rank[s] for s in rows if s >= 0) * 4 + 2 * t * w.out_features * el
        flops_s += sum(2 * case.hidden * w.host_rank[s] for s in rows if s >= 0)
        flops_e += sum(2 * w.out_features * w.host_rank[s] for s in rows if s >= 0)
    return {"shrink_bytes": shrink_b, "expand_bytes": expand_b, "shrink_flops": flops_s, "expand_flops": flops_e}


def engine_order(slots: Sequence[int]) -> list[int]:
    """The rows as the model runner orders a step: grouped by adapter slot, base rows last."""
    return [slots[i] for i in adapter_order(slots)]


def schedules(slots: Sequence[int], decode: bool) -> list[tuple[str, list[int], bool]]:
    """(path name, row slots, decode_only) per timed schedule, all on the same adapters.

    ``engine order``: rows grouped by adapter as every engine step arrives (on cpu the
    in-place row-range path). ``per_token`` / ``segment``: the same rows scattered, as a
    caller that does not group them would pass them (decode-only and general steps)."""
    result = [("engine order", engine_order(slots), decode)]
    if decode:
        result.append(("per_token", list(slots), True))
    result.append(("segment", list(slots), False))
    return result


def bench_case(case: Case, backend, dtype: torch.dtype, timer: Timer) -> list[dict]:
    """One row per schedule (``schedules``); the loop and padded baselines do not depend
    on row order and are timed once."""
    device = backend.device
    weights = make_weights(case.hidden, case.slice_outs, case.adapter_ranks, dtype, device, seed=1,
                           interleaved=getattr(backend.lora, "interleaved_a", False))  # fmt: skip
    slots = case.token_slots()
    t = len(slots)
    x = torch.randn(t, case.hidden, device=device).to(dtype)
    offsets = [sum(case.slice_outs[:i]) for i in range(len(case.slice_outs))]
    y = torch.zeros(t, sum(case.slice_outs), device=device, dtype=dtype)
    workspace = torch.zeros(len(weights), t, max(case.adapter_ranks), device=device)
    padded = Padded(weights)
    token_slots = LoRABatchMeta.build(slots, device).token_slots
    padded_s = timer(lambda: padded(x, y, token_slots, offsets))
    # The loop baseline must compute what the grouped ops compute (same rows, same order).
    y_loop, y_grouped = torch.zeros_like(y), torch.zeros_like(y)  # the deltas alone, so the tolerance is theirs
    per_request_loop(x, y_loop, weights, case.seq_slots, case.rows_per_seq, offsets)
    apply_lora(backend.lora, x, y_grouped, weights, LoRABatchMeta.build(slots, device), offsets, workspace)
    if not torch.allclose(y_loop.float(), y_grouped.float(), rtol=1e-2, atol=1e-2 * float(y_grouped.float().abs().max())):
        raise AssertionError(f"{case.name}: the per-request loop and the grouped ops disagree")
    loop_timer = Timer(device, warmup=1, repeats=5 if case.decode else 3)
    loop_s = loop_timer(lambda: per_request_loop(x, y, weights, case.seq_slots, case.rows_per_seq, offsets))
    rows = []
    for path, path_slots, decode_only in schedules(slots, case.decode):
        meta = LoRABatchMeta.build(path_slots, device, decode_only=decode_only)
        row = {"case": case.name, "rows": t, "adapters": len({s for s in slots if s >= 0}), "hidden": case.hidden,
               "ranks": sorted(set(case.adapter_ranks)), "path": path}
        row["grouped_s"] = timer(lambda: apply_lora(backend.lora, x, y, weights, meta, offsets, workspace))
        row["padded_s"], row["loop_s"] = padded_s, loop_s
        row["speedup_vs_loop"] = loop_s / row["grouped_s"]
        row["speedup_vs_padded"] = padded_s / row["grouped_s"]
        if device.type == "cuda":
            h = workspace[: len(weights), :t]
            row["shrink_s"] = timer(lambda: backend.lora.shrink(x, weights, meta, h))
            row["expand_s"] = timer(lambda: backend.lora.expand(h, weights, meta, y, offsets))
            work = op_bytes_flops(case, weights, dtype)
            for op in ("shrink", "expand"):
                row[f"{op}_GBps"] = work[f"{op}_bytes"] / row[f"{op}_s"] / 1e9
                row[f"{op}_TFLOPps"] = work[f"{op}_flops"] / row[f"{op}_s"] / 1e12
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- LoRA tax

@dataclass(frozen=True)
class StackShape:
    hidden: int
    intermediate: int
    kv: int
    layers: int


class LayerStack:
    """Decoder-layer-like base GEMMs (fused qkv, o, fused gate/up, down) with optional LoRA
    on all seven slices. Attention itself is left out: it costs the same with or without
    LoRA, so leaving it out makes the reported tax an upper bound."""

    def __init__(self, shape: StackShape, ranks: Sequence[int], dtype: torch.dtype, device: torch.device, interleaved: bool = False) -> None:
        h, i, kv = shape.hidden, shape.intermediate, shape.kv
        gen = torch.Generator().manual_seed(2)

        def lin(out_f: int, in_f: int) -> torch.Tensor:
            return (torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)).to(dtype).to(device)

        self.layers = []
        for layer in range(shape.layers):
            seed = 10 * layer
            self.layers.append({
                "qkv": lin(h + 2 * kv, h), "o": lin(h, h), "gate_up": lin(2 * i, h), "down": lin(h, i),
                "lora_qkv": make_weights(h, (h, kv, kv), ranks, dtype, device, seed, interleaved),
                "lora_o": make_weights(h, (h,), ranks, dtype, device, seed + 1),
                "lora_gate_up": make_weights(h, (i, i), ranks, dtype, device, seed + 2, interleaved),
                "lora_down": make_weights(i, (h,), ranks, dtype, device, seed + 3),
            })
        self.shape = shape
        self.workspace = torch.zeros(3, 256, max(ranks), device=device)

    def step(self, x: torch.Tensor, ops, meta: LoRABatchMeta | None) -> torch.Tensor:
        s = self.shape
        for p in self.layers:
            qkv = x @ p["qkv"].t()
            if meta is not None:
                apply_lora(ops, x, qkv, p["lora_qkv"], meta, [0, s.hidden, s.hidden + s.kv], self.workspace)
            attn = qkv[:, : s.hidden].contiguous()  # stands in for attention's output
            o = attn @ p["o"].t()
            if meta is not None:
                apply_lora(ops, attn, o, p["lora_o"], meta, [0], self.workspace)
            x = x + o
            gu = x @ p["gate_up"].t()
            if meta is not None:
                apply_lora(ops, x, gu, p["lora_gate_up"], meta, [0, s.intermediate], self.workspace)
            act = (F.silu(gu[:, : s.intermediate]) * gu[:, s.intermediate :]).contiguous()
            d = act @ p["down"].t()
            if meta is not None:
                apply_lora(ops, act, d, p["lora_down"], meta, [0], self.workspace)
            x = x + d
        return x


def bench_tax(backend, dtype: torch.dtype, timer: Timer, shape: StackShape, rank: int = 16, rows: int = 64, adapters: int = 8) -> list[dict]:
    """Tax per schedule (``schedules``: engine order, then the same rows scattered)."""
    device = backend.device
    stack = LayerStack(shape, [rank] * adapters, dtype, device, interleaved=getattr(backend.lora, "interleaved_a", False))
    slots = list(scattered(rows, adapters, 3))
    x = torch.randn(rows, shape.hidden, device=device).to(dtype)
    result = []
    for path, path_slots, decode_only in schedules(slots, decode=True):
        meta = LoRABatchMeta.build(path_slots, device, decode_only=decode_only)
        base, lora, tax = timer.tax(lambda: stack.step(x, backend.lora, None), lambda: stack.step(x, backend.lora, meta))
        result.append({"shape": asdict(shape), "rank": rank, "rows": rows, "adapters": adapters,
                       "path": path, "base_s": base, "lora_s": lora, "tax": tax})
    return result


# ---------------------------------------------------------------------------- cuda extras

def ceilings(device: torch.device, timer: Timer) -> dict:
    """Measured in this run: device-to-device copy bandwidth and bf16 matmul rate."""
    src = torch.empty(1 << 29, dtype=torch.uint8, device=device)  # 512 MiB
    dst = torch.empty_like(src)
    copy_s = timer(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_s = timer(lambda: a @ b)
    return {"copy_GBps": 2 * src.numel() / copy_s / 1e9, "bf16_matmul_TFLOPps": 2 * 8192**3 / mm_s / 1e12}


LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
# cpu: the op cases' hidden size 1024 in a small whole model (8 layers, Llama-2 vocabulary)
LLAMA_SMALL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
MODEL_TAX = {"cuda": dict(dims=LLAMA_1B, dtype="bfloat16", adapters=32), "cpu": dict(dims=LLAMA_SMALL, dtype="float32", adapters=8)}


def whole_model_tax(backend, timer: Timer, dims: dict = LLAMA_1B, dtype: str = "bfloat16",
                    adapters: int = 32, rank: int = 16, rows: int = 64) -> dict:
    """Decode-step time of a random Llama (1B-class on cuda, hidden 1024 x 8 layers on cpu)
    through ModelRunner, every row with one of ``adapters`` adapters (rank 16 on
    q/k/v/o/gate/up/down), vs the same rows with no adapter: attention over 128 tokens of
    context, norms and the LM head included, as in a real step."""
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner, SeqStep
    from tests.fixtures.tiny_models import build_tiny_model

    torch_dtype = getattr(torch, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "llama", "llama", seed=0, dtype=torch_dtype, **dims)
        config = EngineConfig(model=str(model_dir), device=backend.device.type, dtype=dtype, max_loras=adapters, max_lora_rank=rank,
                              max_num_seqs=rows, max_num_batched_tokens=max(rows, 256), max_model_len=512, num_kv_blocks=rows * 8)
        runner = ModelRunner(config, backend)
    gen = torch.Generator().manual_seed(4)
    for slot in range(adapters):
        for _, _, w in runner.model.all_slices():
            a = torch.randn(rank, w.in_features, generator=gen) / math.sqrt(w.in_features)
            b = torch.randn(w.out_features, rank, generator=gen) / math.sqrt(rank)
            w.write_slot(slot, slot * rank, a.to(torch_dtype), b.to(torch_dtype), 2.0)
    slots = scattered(rows, adapters, 5)
    context = 128

    def steps(with_lora: bool) -> list:
        return [SeqStep([7], context - 1, list(range(i * 8, i * 8 + 8)), slots[i] if with_lora else -1, True) for i in range(rows)]

    lora_steps, base_steps = steps(True), steps(False)
    base, lora, tax = timer.tax(lambda: runner.execute(base_steps), lambda: runner.execute(lora_steps), pairs=15)
    return {"model": dims, "dtype": dtype, "adapters": adapters, "rank": rank, "rows": rows, "context": context,
            "base_s": base, "lora_s": lora, "tax": tax}


# ---------------------------------------------------------------------------- report

def table(rows: list[dict], cuda: bool) -> str:
    head = "| case | path | rows | adapters | grouped ms | loop ms | padded ms | vs loop | vs padded |"
    sep = "|---|---|---|---|---|---|---|---|---|"
    if cuda:
        head += " shrink GB/s | expand GB/s | shrink TFLOP/s | expand TFLOP/s |"
        sep += "---|---|---|---|"
    lines = [head, sep]
    for r in rows:
        line = (f"| {r['case']} | {r['path']} | {r['rows']} | {r['adapters']} | {r['grouped_s'] * 1e3:.3f} | "
                f"{r['loop_s'] * 1e3:.3f} | {r['padded_s'] * 1e3:.3f} | {r['speedup_vs_loop']:.1f}x | {r['speedup_vs_padded']:.2f}x |")
        if cuda:
            line += f" {r['shrink_GBps']:.0f} | {r['expand_GBps']:.0f} | {r['shrink_TFLOPps']:.2f} | {r['expand_TFLOPps']:.2f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu", help="backend to benchmark (default cpu)")
    parser.add_argument("--json", type=Path, default=None, help="also write all results to this JSON file")
    parser.add_argument("--threads", type=int, default=None, help="cpu: torch intra-op threads (default: torch's choice)")
    parser.add_argument("--skip-model", action="store_true",
                        help="skip the whole-model decode-step tax (cuda: 1B-class Llama; cpu: hidden 1024, 8 layers)")  # fmt: skip
    args = parser.parse_args(argv)

    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    try:
        backend = get_backend(args.device)
    except BackendUnavailable as err:  # one line, not a traceback
        parser.error(str(err))
    dtype = DTYPES[args.device]
    timer = Timer(backend.device)
    torch.manual_seed(0)
    result: dict = {"device": args.device, "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
                    "host": platform.node(), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}
    failed: list[str] = []

    def write_json() -> None:
        """The results so far, replaced atomically: a run killed or failing later keeps what finished."""
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            partial = args.json.with_name(args.json.name + ".partial")
            partial.write_text(json.dumps(result, indent=2))
            partial.replace(args.json)

    def section(key: str, measure: Callable[[], Any]) -> None:
        """``result[key] = measure()``; an exception is recorded there (and printed), never swallowed, and the rest still runs."""
        try:
            result[key] = measure()
        except Exception as err:
            result[key] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            failed.append(key)
            print(f"{key}: FAILED: {result[key]['error']}", file=sys.stderr)
        write_json()

    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
        section("ceilings", lambda: ceilings(backend.device, timer))
    section("ops", lambda: [row for c in cases(args.device) for row in bench_case(c, backend, dtype, timer)])
    small = args.device == "cpu"
    shape = StackShape(1024, 2816, 256, 2) if small else StackShape(4096, 11008, 1024, 4)
    section("tax_stack", lambda: bench_tax(backend, dtype, timer, shape))
    if args.device in MODEL_TAX and not args.skip_model:
        section("tax_model", lambda: whole_model_tax(backend, timer, **MODEL_TAX[args.device]))

    print(f"device={args.device} dtype={result['dtype']} torch={result['torch']} threads={result['threads']}")
    if "ceilings" in result and "ceilings" not in failed:
        c = result["ceilings"]
        print(f"ceilings: copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPps']:.0f} TFLOP/s")
    if "ops" not in failed:
        print(table(result["ops"], args.device == "cuda"))
    for t in result["tax_stack"] if "tax_stack" not in failed else []:
        print(f"LoRA tax ({t['path']}), {t['shape']['layers']}-layer stack hidden {t['shape']['hidden']}, rank {t['rank']}, "
              f"{t['rows']} rows / {t['adapters']} adapters: base {t['base_s'] * 1e3:.2f} ms, with LoRA {t['lora_s'] * 1e3:.2f} ms, "
              f"tax {t['tax'] * 100:.1f}%")
    if "tax_model" in result and "tax_model" not in failed:
        m = result["tax_model"]
        d = m["model"]
        print(f"whole-model tax (Llama hidden {d['hidden_size']} x {d['num_hidden_layers']} layers, vocab {d['vocab_size']}, {m['dtype']}, "
              f"{m['adapters']} adapters, rank {m['rank']}, {m['rows']} decode rows, context {m['context']}): "
              f"base {m['base_s'] * 1e3:.2f} ms, with LoRA {m['lora_s'] * 1e3:.2f} ms, tax {m['tax'] * 100:.1f}%")
    if failed:
        print(f"lora_ops: {len(failed)} section(s) failed: {', '.join(failed)} (errors and tracebacks in the JSON)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
