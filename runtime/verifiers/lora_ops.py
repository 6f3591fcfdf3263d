"""Verifiers for the LoRA op capabilities: segment, per-token, mixed ranks, multi-slice.

Each runs the backend's shrink/expand through the contract (``backend.lora``) on fresh
random problems (``lora_problem.py``) and compares with float64, for every declared
dtype and over ranks the declared limits admit (smallest, largest, random others). A
declared fallback is exercised too, over its own limits.

Besides slices of different widths, every op verifier runs an equal-width case
(``batched_expand_case``): the layout of real adapters on q/k/v without GQA or gate/up,
one rank and one scale per adapter across its slices. On the CPU backend that is the
one-``baddbmm_`` expand of ``apply_row_ranges``, and the verifier checks it ran.
"""
from __future__ import annotations

from typing import Any

import torch

from runtime.capabilities import Capability, CapabilityMatrix, Limits
from runtime.verifiers.lora_problem import build_problem, check_lora_ops
from runtime.verifiers.result import VerificationFailure, VerifierResult, verifier
from runtime.verifiers.sampling import declared_dtypes, fresh_seed, pick_ranks, torch_dtype

IN_FEATURES = 32
QKV_OUTS = (32, 16, 48)  # three slices of different widths (q, k, v)
EQUAL_OUTS = (16, 16, 16)  # three slices of one width (q/k/v without GQA; gate/up likewise)
DEFAULT_SLOTS = 4


def _summarise(runs: list[tuple[str, dict[str, float]]]) -> tuple[str, dict[str, Any]]:
    worst = max(m["tol_used"] for _, m in runs)
    errs = {label: max(m["shrink_err"], m["expand_err"], m["apply_err"]) for label, m in runs}
    ms = sum(m["shrink_ms"] + m["expand_ms"] for _, m in runs)
    detail = f"{len(runs)} problems; max err " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items()) + f"; {worst:.0%} of tolerance"
    return detail, {"max_err": errs, "tol_used": worst, "op_ms": round(ms, 2)}


def _op_cases(entry: Capability) -> list[tuple[str, Limits]]:
    cases = [("", entry.limits)]
    if entry.fallback is not None:
        cases.append(("fallback ", entry.fallback.limits))
    return cases


def _run_op_capability(backend: Any, entry: Capability, matrix: CapabilityMatrix, decode_only: bool) -> VerifierResult:
    runs = []
    for label, limits in _op_cases(entry):
        n_slots = limits.max_adapters_per_batch or DEFAULT_SLOTS
        for name in declared_dtypes(entry, matrix, limits):
            seed = fresh_seed()
            ranks = pick_ranks(limits, n_slots, seed)
            if not ranks:
                raise VerificationFailure(f"{entry.key}: the declared limits admit no rank")
            extra = 4
            if limits.max_rows_per_launch is not None:  # verify exactly at the declared row limit
                extra = max(0, limits.max_rows_per_launch - n_slots - 3)
            p = build_problem(backend.device, torch_dtype(name), ranks, QKV_OUTS, IN_FEATURES, seed,
                              extra_rows=extra, untargeted=frozenset({(1, 0)}), interleaved=interleaved_a(backend))
            runs.append((f"{label}{name}", check_lora_ops(backend, p, decode_only)))
    for name in declared_dtypes(entry, matrix):
        seed = fresh_seed()
        runs.append((f"equal widths {name}", batched_expand_case(backend, name, pick_ranks(entry.limits, DEFAULT_SLOTS, seed), seed, decode_only)))
    groups = entry.limits.max_groups_per_call
    if groups is not None:  # one rank bucket with more groups than one call takes: the split must be right
        seed = fresh_seed()
        rank = entry.limits.admissible_ranks()[0]
        name = declared_dtypes(entry, matrix)[0]
        p = build_problem(backend.device, torch_dtype(name), [rank] * (groups + 2), (16,), 16, seed, extra_rows=2, no_adapter_rows=2)
        runs.append((f"{groups + 2} groups {name}", check_lora_ops(backend, p, decode_only)))
    detail, metrics = _summarise(runs)
    return VerifierResult("pass", detail, metrics)


def interleaved_a(backend: Any) -> bool:
    """Whether the model would allocate fused projections' A rows interleaved for this backend."""
    return bool(getattr(backend.lora, "interleaved_a", False))


def runs_batched_expand(backend: Any, dtype: torch.dtype) -> bool:
    """Whether ``backend.lora`` declares the one-``baddbmm_`` expand for an equal-width problem in
    ``dtype`` (backends/reference.py ``apply_row_ranges``: float32, interleaved A and B rows)."""
    from backends.reference import ReferenceLoRAOps

    return isinstance(backend.lora, ReferenceLoRAOps) and interleaved_a(backend) and dtype == torch.float32


def batched_expand_case(backend: Any, name: str, ranks: list[int], seed: int, decode_only: bool) -> dict[str, Any]:
    """Three slices of one width, their columns side by side, every adapter at one rank in all of
    them (ranks differ across adapters), no-adapter rows; every slot but the last with one scale
    across its slices (PEFT's alpha / r), the last with a scale per slice. Checked against float64
    like every problem, and where the backend has the batched expand (``runs_batched_expand``) the
    engine-order apply must have run it, one ``baddbmm_`` per one-scale adapter's segment: the
    equal-width adapters real deployments load must not be left to a path no check reaches."""
    if len(ranks) < 2:
        raise VerificationFailure(f"equal-width case: need two adapters, the limits give ranks {ranks}")
    shared = frozenset(range(len(ranks) - 1))
    dtype = torch_dtype(name)
    p = build_problem(backend.device, dtype, ranks, EQUAL_OUTS, IN_FEATURES, seed, gap=0, shared_scale=shared,
                      interleaved=interleaved_a(backend))
    metrics = check_lora_ops(backend, p, decode_only, observe=True)
    if runs_batched_expand(backend, dtype):
        ran = metrics["engine_order_calls"].get("baddbmm_", 0)
        if ran < len(shared):
            path = "per-token" if decode_only else "segment"
            raise VerificationFailure(
                f"equal-width case ({path} {name}, ranks {ranks}, seed {seed}): the batched expand (one baddbmm_ per "
                f"adapter segment with one rank and scale) ran {ran} times for {len(shared)} such adapters; "
                "apply_row_ranges took the per-slice path, so this check did not verify the path real adapters use"
            )
    return metrics


@verifier("lora_ops_segment")
def verify_lora_ops_segment(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    """Segment (SGMV, prefill) shrink/expand vs float64, per declared dtype, mixed ranks, no-adapter rows."""
    return _run_op_capability(backend, entry, matrix, decode_only=False)


@verifier("lora_ops_per_token")
def verify_lora_ops_per_token(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    """Per-token (BGMV, decode) shrink/expand vs float64, primary limits and declared fallback."""
    return _run_op_capability(backend, entry, matrix, decode_only=True)


@verifier("mixed_ranks")
def verify_mixed_ranks(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    """Distinct ranks in one batch, buffers sized to the exact sum of ranks (no padding), both paths."""
    seed = fresh_seed()
    admissible = entry.limits.admissible_ranks()
    ranks = sorted(set(pick_ranks(entry.limits, 5, seed)))
    if len(ranks) < 2:
        raise VerificationFailure(f"{entry.key}: the declared limits admit only {admissible[:2]}, not mixed ranks")
    name = matrix.entry(entry.backend, "dtypes").limits.dtypes[0]
    runs = []
    for decode_only, path in ((False, "lora_ops_segment"), (True, "lora_ops_per_token")):
        if not matrix.entry(entry.backend, path).supported:
            continue
        p = build_problem(backend.device, torch_dtype(name), ranks, QKV_OUTS[:1], IN_FEATURES, seed)
        runs.append(("per-token" if decode_only else "segment", check_lora_ops(backend, p, decode_only)))
    detail, metrics = _summarise(runs)
    return VerifierResult("pass", f"ranks {ranks} ({name}); " + detail, metrics)


@verifier("multi_slice_expand")
def verify_multi_slice_expand(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    """Three slices of different widths in one expand call, gaps between them, untargeted slices;
    then three of one width side by side, one rank and scale per adapter (``batched_expand_case``)."""
    runs = []
    ops = matrix.entry(entry.backend, "lora_ops_segment").limits
    for name in declared_dtypes(entry, matrix):
        seed = fresh_seed()
        ranks = pick_ranks(ops, 3, seed)
        for decode_only in (False, True):
            p = build_problem(backend.device, torch_dtype(name), ranks, QKV_OUTS, IN_FEATURES, seed,
                              untargeted=frozenset({(1, 0), (2, 2)}), interleaved=interleaved_a(backend))
            runs.append((f"{'per-token' if decode_only else 'segment'} {name}", check_lora_ops(backend, p, decode_only)))
            runs.append((f"{'per-token' if decode_only else 'segment'} equal widths {name}",
                         batched_expand_case(backend, name, ranks, seed, decode_only)))
    detail, metrics = _summarise(runs)
    return VerifierResult("pass", f"{len(QKV_OUTS)} slices of widths {QKV_OUTS} and of {EQUAL_OUTS}; " + detail, metrics)
