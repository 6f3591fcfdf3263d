"""Verifiers for the LoRA op capabilities: segment, per-token, mixed ranks, multi-slice.

Each runs the backend's shrink/expand through the contract (``backend.lora``) on fresh
random problems (``lora_problem.py``) and compares with float64, for every declared
dtype and over ranks the declared limits admit (smallest, largest, random others). A
declared fallback is exercised too, over its own limits.
"""
from __future__ import annotations

from typing import Any

from runtime.capabilities import Capability, CapabilityMatrix, Limits
from runtime.verifiers.lora_problem import build_problem, check_lora_ops
from runtime.verifiers.result import VerificationFailure, VerifierResult, verifier
from runtime.verifiers.sampling import declared_dtypes, fresh_seed, pick_ranks, torch_dtype

IN_FEATURES = 32
QKV_OUTS = (32, 16, 48)  # three slices of different widths (q, k, v)
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
    """Three slices of different widths in one expand call, gaps between them, untargeted slices."""
    runs = []
    ops = matrix.entry(entry.backend, "lora_ops_segment").limits
    for name in declared_dtypes(entry, matrix):
        seed = fresh_seed()
        ranks = pick_ranks(ops, 3, seed)
        for decode_only in (False, True):
            p = build_problem(backend.device, torch_dtype(name), ranks, QKV_OUTS, IN_FEATURES, seed,
                              untargeted=frozenset({(1, 0), (2, 2)}), interleaved=interleaved_a(backend))
            runs.append((f"{'per-token' if decode_only else 'segment'} {name}", check_lora_ops(backend, p, decode_only)))
    detail, metrics = _summarise(runs)
    return VerifierResult("pass", f"{len(QKV_OUTS)} slices; " + detail, metrics)
