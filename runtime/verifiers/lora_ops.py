"""Verifiers for the LoRA op capabilities: segment, per-token, mixed ranks, multi-slice.

Each runs the backend's shrink/expand through the contract (``backend.lora``) on fresh
random problems (``lora_problem.py``) and compares with float64, for every declared
dtype and over ranks the declared limits admit (smallest, largest, random others).
Slice offsets and widths sit on 16-column boundaries (``lora_problem.ALIGN``), as a model's
do, so limits such as those of torch_npu's fused decode op hold and the primary path runs.

Besides slices of different widths, every op verifier runs an equal-width case
(``batched_expand_case``): the layout of real adapters on q/k/v without GQA or gate/up,
one rank and one scale per adapter across its slices. On the CPU backend that is the
one-``baddbmm_`` expand of ``apply_row_ranges``, and the verifier checks it ran. The op
verifiers (segment, per-token) also run

- ``tiles``: in_features 160 and a 144-wide slice at rank >= 64 (several K tiles and column
  blocks in the kernels) and, on the segment path, a 70-row segment (several row tiles);
- ``fp32 accumulate`` (accumulation.py): sums that cancel, the tolerance on the result, per
  half-precision dtype, so an op summing in fp16/bf16 fails;
- the declared fallback, if any, on the backend forced onto it (``paths.forced_fallback``),
  over the fallback's limits, and, where the fallback admits ranks the primary limits do not,
  one step mixing both (``op+fallback``) on the backend as it is.

Which path ran is checked (``paths.expect_path``, through the backend's fallback log): a case
inside the primary limits must take no fallback in ``apply_lora`` other than the chip's own
(``chip_fallback_reasons``; the result then says so), a fallback case must take it.
"""
from __future__ import annotations

from typing import Any

import torch

from runtime.capabilities import Capability, CapabilityMatrix, Limits
from runtime.verifiers.accumulation import cancelling, keeps_h_in_fp32
from runtime.verifiers.gate_adapter import GateAdapter
from runtime.verifiers.lora_problem import LoRAProblem, build_problem, check_lora_ops, rewrite_slots
from runtime.verifiers.paths import expect_path, forced_fallback
from runtime.verifiers.result import VerificationFailure, VerifierResult, verifier
from runtime.verifiers.sampling import declared_dtypes, fresh_seed, pick_ranks, torch_dtype

IN_FEATURES = 32
QKV_OUTS = (32, 16, 48)  # three slices of different widths (q, k, v)
EQUAL_OUTS = (16, 16, 16)  # three slices of one width (q/k/v without GQA; gate/up likewise)
DEFAULT_SLOTS = 4
# ``tiles``: in 160 > the segment kernels' 64-wide and the per-token kernels' 128-wide K tile (8192 //
# the 64-row rank tile); a 144-wide slice > one 128-column block; a 70-row segment > one 64-row tile.
TILE_IN, TILE_OUTS, TILE_RANK, LONG_SEGMENT = 160, (144, 16), 64, 70
HALF_DTYPES = ("float16", "bfloat16")


def _summarise(runs: list[tuple[str, dict[str, Any]]], notes: tuple[str, ...] = ()) -> tuple[str, dict[str, Any]]:
    worst = max(m["tol_used"] for _, m in runs)
    errs = {label: max(m["shrink_err"], m["expand_err"], m["apply_err"]) for label, m in runs}
    ms = sum(m["shrink_ms"] + m["expand_ms"] for _, m in runs)
    detail = f"{len(runs)} problems; max err " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items()) + f"; {worst:.0%} of tolerance"
    return "; ".join((detail, *notes)), {"max_err": errs, "tol_used": worst, "op_ms": round(ms, 2)}


def _checked(backend: Any, p: LoRAProblem, decode_only: bool, label: str, primary: bool,
             reasons: frozenset[str] | None = None, tight: bool = False) -> tuple[str, dict[str, Any]]:
    """``check_lora_ops`` and the path it took: ``primary`` -> no fallback (on the segment path not in the
    direct shrink/expand either), else the fallback, with only ``reasons`` if given."""
    try:
        metrics = check_lora_ops(backend, p, decode_only, tight=tight)
    except VerificationFailure as err:
        raise VerificationFailure(f"case {label!r}: {err}") from None
    tag = f"{label} ({'per-token' if decode_only else 'segment'}, seed {p.seed})"
    expect_path(metrics["apply_fallbacks"], tag, primary, reasons)
    if primary and not decode_only:
        expect_path(metrics["ops_fallbacks"], tag + ", direct shrink/expand", primary)
    return label, metrics


def inside(limits: Limits, name: str, ranks: list[int]) -> bool:
    """Whether a problem in dtype ``name`` with ``ranks`` lies within ``limits``."""
    admissible = set(limits.admissible_ranks())
    return (limits.dtypes is None or name in limits.dtypes) and all(r in admissible for r in ranks)


def _accumulation_cases(backend: Any, names: tuple[str, ...], limits: Limits, decode_only: bool, label: str, primary: bool,
                        reasons: frozenset[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The fp32-accumulate problems (accumulation.py) for each half dtype among ``names``."""
    runs = []
    for name in (n for n in names if n in HALF_DTYPES):
        seed = fresh_seed()
        ranks = pick_ranks(limits, 3, seed, even=True)
        if not ranks:
            raise VerificationFailure(f"fp32 accumulate: the limits admit no even rank to pair rows in ({label}{name})")
        for exact_h in (True, False) if keeps_h_in_fp32(backend) else (True,):
            p = build_problem(backend.device, torch_dtype(name), ranks, (32,), IN_FEATURES, seed)
            what = "fp32 accumulate" if exact_h else "fp32 h, cast once"
            runs.append(_checked(backend, cancelling(p, exact_h), decode_only, f"{label}{what} {name}", primary, reasons, tight=True))
    return runs


def check_target_modules(entry: Capability, matrix: CapabilityMatrix) -> str:
    """The entry's ``target_modules`` against the runtime: each is a module the adapter loader takes
    (``LORA_TARGET_MODULES``) and the adapter gate admits; each one the model has that the entry
    leaves out is refused by the gate. Returns a note for the verifier's detail."""
    from runtime.capabilities import CapabilityError, check_adapter
    from runtime.models.llama import LORA_TARGET_MODULES

    declared = entry.limits.target_modules
    if declared is None:
        return f"target modules: any of {len(LORA_TARGET_MODULES)}"
    unknown = [m for m in declared if m not in LORA_TARGET_MODULES]
    if unknown:
        raise VerificationFailure(f"{entry.key}: declares target module(s) {', '.join(unknown)}, which the adapter loader never "
                                  f"accepts (it loads {', '.join(LORA_TARGET_MODULES)})")  # fmt: skip
    rank = matrix.entry(entry.backend, "max_rank").limits.admissible_ranks()[0]
    for module in LORA_TARGET_MODULES:
        adapter = GateAdapter(f"probe-{module}", {(0, module): rank})
        try:
            check_adapter(adapter, entry.backend, matrix)
        except CapabilityError as err:
            if module in declared or f"target module {module!r}" not in str(err):
                raise VerificationFailure(f"{entry.key}: the adapter gate refuses an adapter of rank {rank} on {module}: {err}") from err
        else:
            if module not in declared:
                raise VerificationFailure(f"{entry.key}: leaves out target module {module}, but the adapter gate admits an adapter on it")
    return f"target modules: {len(declared)} admitted, {len(LORA_TARGET_MODULES) - len(declared)} refused"


def _run_op_capability(backend: Any, entry: Capability, matrix: CapabilityMatrix, decode_only: bool) -> VerifierResult:
    runs, notes = [], [check_target_modules(entry, matrix)]
    limits = entry.limits
    n_slots = limits.max_adapters_per_batch or DEFAULT_SLOTS
    names = declared_dtypes(entry, matrix)
    for name in names:
        seed = fresh_seed()
        ranks = pick_ranks(limits, n_slots, seed)
        if not ranks:
            raise VerificationFailure(f"{entry.key}: the declared limits admit no rank")
        extra = 4
        if limits.max_rows_per_launch is not None:  # verify exactly at the declared row limit
            extra = max(0, limits.max_rows_per_launch - n_slots - 3)
        p = build_problem(backend.device, torch_dtype(name), ranks, QKV_OUTS, IN_FEATURES, seed,
                          extra_rows=extra, untargeted=frozenset({(1, 0)}), interleaved=interleaved_a(backend))
        runs.append(_checked(backend, p, decode_only, name, primary=True))
        # The same slots rewritten in place (a hot update into the same rows): nothing computed from
        # the first weights may be used again.
        runs.append(_checked(backend, rewrite_slots(p, fresh_seed()), decode_only, f"{name}, slots rewritten", primary=True))
    for name in names:
        seed = fresh_seed()
        metrics = batched_expand_case(backend, name, pick_ranks(limits, DEFAULT_SLOTS, seed), seed, decode_only)
        expect_path(metrics["apply_fallbacks"], f"equal widths {name} (seed {seed})", primary=True)
        runs.append((f"equal widths {name}", metrics))
    seed = fresh_seed()
    admissible = limits.admissible_ranks()
    big = next((r for r in admissible if r >= TILE_RANK), admissible[-1])
    p = build_problem(backend.device, torch_dtype(names[0]), [big, admissible[0]], TILE_OUTS, TILE_IN, seed,
                      extra_rows=2, slot_rows=() if decode_only else (LONG_SEGMENT,))
    runs.append(_checked(backend, p, decode_only, f"tiles {names[0]}", primary=True))
    runs += _accumulation_cases(backend, names, limits, decode_only, "", primary=True)
    groups = limits.max_groups_per_call
    if groups is not None:  # one rank bucket with more groups than one call takes: the split must be right
        seed = fresh_seed()
        p = build_problem(backend.device, torch_dtype(names[0]), [admissible[0]] * (groups + 2), (16,), 16, seed, extra_rows=2, no_adapter_rows=2)
        runs.append(_checked(backend, p, decode_only, f"{groups + 2} groups {names[0]}", primary=True))
    if entry.fallback is not None:
        runs += _fallback_cases(backend, entry, matrix, decode_only, notes)
    chip = frozenset(getattr(backend, "chip_fallback_reasons", frozenset()))
    if chip:
        notes.append(f"on {getattr(backend, 'soc_name', 'this chip')} the declared fallback may serve primary cases "
                     f"({', '.join(sorted(chip))}), so the device op is verified only where it ran")
    elif getattr(backend, "fallbacks", None) is not None:
        notes.append("primary cases took no fallback (the backend's fallback log)")
    detail, metrics = _summarise(runs, tuple(notes))
    return VerifierResult("pass", detail, metrics)


def _fallback_cases(backend: Any, entry: Capability, matrix: CapabilityMatrix, decode_only: bool, notes: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """The declared fallback over its own limits, on the backend forced onto it; then, where the fallback
    admits ranks the primary limits do not, one step mixing both on the backend as it is."""
    limits = entry.fallback.limits
    forced, reasons, how = forced_fallback(backend, entry.name)
    runs = []
    names = declared_dtypes(entry, matrix, limits)
    for name in names:
        seed = fresh_seed()
        ranks = pick_ranks(limits, limits.max_adapters_per_batch or DEFAULT_SLOTS, seed)
        p = build_problem(forced.device, torch_dtype(name), ranks, QKV_OUTS, IN_FEATURES, seed,
                          untargeted=frozenset({(1, 0)}), interleaved=interleaved_a(forced), align=1)
        runs.append(_checked(forced, p, decode_only, f"fallback {name}", False, reasons))
    runs += _accumulation_cases(forced, names, limits, decode_only, "fallback ", False, reasons)
    taken = sorted(set().union(*(m["apply_fallbacks"].taken for _, m in runs)))
    notes.append(f"fallback cases forced onto the fallback ({how}); apply_lora noted {', '.join(taken)}")
    primary_ranks = set(entry.limits.admissible_ranks())
    outside = [r for r in limits.admissible_ranks() if r not in primary_ranks]
    shared = [n for n in declared_dtypes(entry, matrix) if n in names]
    if outside and shared:
        seed = fresh_seed()
        ranks = pick_ranks(entry.limits, 2, seed) + [outside[0], outside[-1]]
        p = build_problem(backend.device, torch_dtype(shared[0]), ranks, QKV_OUTS, IN_FEATURES, seed,
                          untargeted=frozenset({(1, 0)}), interleaved=interleaved_a(backend))
        runs.append(_checked(backend, p, decode_only, f"op+fallback ranks {ranks} {shared[0]}", primary=False))
        notes.append("op+fallback: ranks inside and outside the primary limits in one step, the fallback taken for the latter")
    return runs


def interleaved_a(backend: Any) -> bool:
    """Whether the model would allocate fused projections' A rows interleaved for this backend."""
    return bool(getattr(backend.lora, "interleaved_a", False))


def runs_batched_expand(backend: Any, dtype: torch.dtype) -> bool:
    """Whether ``backend.lora`` declares the one-``baddbmm_`` expand for an equal-width problem in
    ``dtype`` (backends/reference.py ``apply_row_ranges``: interleaved A and B rows; it works in
    float32, other dtypes on float32 copies, so every dtype)."""
    from backends.reference import ReferenceLoRAOps

    return isinstance(backend.lora, ReferenceLoRAOps) and interleaved_a(backend) and dtype in (torch.float32, torch.bfloat16, torch.float16)


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
    """Distinct ranks in one batch, buffers sized to the exact sum of ranks (no padding), both paths,
    each with ranks its own limits admit (and ``entry``'s), so the primary implementation mixes them."""
    name = matrix.entry(entry.backend, "dtypes").limits.dtypes[0]
    runs, mixed = [], {}
    for decode_only, path in ((False, "lora_ops_segment"), (True, "lora_ops_per_token")):
        limits = matrix.entry(entry.backend, path).limits
        if not matrix.entry(entry.backend, path).supported:
            continue
        seed = fresh_seed()
        ranks = sorted(set(pick_ranks(limits, 5, seed)) & set(entry.limits.admissible_ranks()))
        if len(ranks) < 2:
            raise VerificationFailure(f"{entry.key}: {path} and the declared limits admit {ranks}, not mixed ranks")
        p = build_problem(backend.device, torch_dtype(name), ranks, QKV_OUTS[:1], IN_FEATURES, seed)
        label = "per-token" if decode_only else "segment"
        runs.append(_checked(backend, p, decode_only, label, primary=True) if inside(limits, name, ranks)
                    else (label, check_lora_ops(backend, p, decode_only)))
        mixed[label] = ranks
    detail, metrics = _summarise(runs)
    return VerifierResult("pass", "ranks " + ", ".join(f"{k} {v}" for k, v in mixed.items()) + f" ({name}); " + detail, metrics)


@verifier("multi_slice_expand")
def verify_multi_slice_expand(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    """Three slices of different widths in one expand call, gaps between them, untargeted slices;
    then three of one width side by side, one rank and scale per adapter (``batched_expand_case``).
    Ranks come from each path's own limits; a problem inside them must take no fallback (but the chip's own)."""
    runs = []
    for name in declared_dtypes(entry, matrix):
        for decode_only, path in ((False, "lora_ops_segment"), (True, "lora_ops_per_token")):
            seed = fresh_seed()
            limits = matrix.entry(entry.backend, path).limits
            ranks = pick_ranks(limits, 3, seed)
            label = f"{'per-token' if decode_only else 'segment'} {name}"
            p = build_problem(backend.device, torch_dtype(name), ranks, QKV_OUTS, IN_FEATURES, seed,
                              untargeted=frozenset({(1, 0), (2, 2)}), interleaved=interleaved_a(backend))
            metrics = check_lora_ops(backend, p, decode_only)
            equal = batched_expand_case(backend, name, ranks, seed, decode_only)
            if inside(limits, name, ranks):
                expect_path(metrics["apply_fallbacks"], f"{label} (seed {seed})", primary=True)
                expect_path(equal["apply_fallbacks"], f"{label} equal widths (seed {seed})", primary=True)
            runs += [(label, metrics), (f"{label} equal widths", equal)]
    detail, metrics = _summarise(runs)
    return VerifierResult("pass", f"{len(QKV_OUTS)} slices of widths {QKV_OUTS} and of {EQUAL_OUTS}; " + detail, metrics)
