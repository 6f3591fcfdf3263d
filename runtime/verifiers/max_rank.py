"""Verifier for max_rank: an adapter at exactly the declared max rank runs correctly
(mixed with the smallest rank, both paths), is accepted by the gate, and one
granularity step above it is refused at adapter load with the matrix's words, as is an
engine config asking for it (``max_lora_rank``, the engine's start-up gate)."""
from __future__ import annotations

from typing import Any

from runtime.capabilities import Capability, CapabilityError, CapabilityMatrix, check_adapter, check_engine_config
from runtime.verifiers.gate_adapter import GateAdapter
from runtime.verifiers.lora_problem import build_problem, check_lora_ops
from runtime.verifiers.result import VerificationFailure, VerifierResult, probe_engine_config, verifier
from runtime.verifiers.sampling import fresh_seed, torch_dtype


@verifier("max_rank")
def verify_max_rank(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    top = entry.limits.max_rank
    if top is None:
        raise VerificationFailure(f"{entry.key}: declares no max_rank")
    low = entry.limits.admissible_ranks()[0]
    check_adapter(GateAdapter("probe-max-rank", {(0, "q_proj"): top}), entry.backend, matrix)  # must not raise
    above = top + (entry.limits.rank_granularity or 1)
    try:
        check_adapter(GateAdapter("probe-above-max-rank", {(0, "q_proj"): above}), entry.backend, matrix)
    except CapabilityError as err:
        refusal = str(err)
    else:
        raise VerificationFailure(f"an adapter of rank {above} > max_rank {top} was not refused")
    if entry.quote() not in refusal:
        raise VerificationFailure(f"the refusal of rank {above} does not quote the matrix entry: {refusal}")
    # The engine's own start-up gate: a config asking for more than max_rank is refused, one at it is not.
    check_engine_config(probe_engine_config(entry.backend, matrix, max_lora_rank=top), entry.backend, matrix)
    try:
        check_engine_config(probe_engine_config(entry.backend, matrix, max_lora_rank=above), entry.backend, matrix)
    except CapabilityError as err:
        if entry.quote() not in str(err):
            raise VerificationFailure(f"max_lora_rank={above} was refused, but not quoting the matrix entry: {err}") from err
    else:
        raise VerificationFailure(f"an engine config with max_lora_rank={above} > max_rank {top} was not refused (check_engine_config)")
    name = matrix.entry(entry.backend, "dtypes").limits.dtypes[0]
    seed = fresh_seed()
    errs = []
    for decode_only in (False, True):
        # align=1: slice offset 1, y 36 wide; the one problem of the probe off 16-column boundaries
        p = build_problem(backend.device, torch_dtype(name), [top, low, top], (32,), 32, seed, align=1)
        m = check_lora_ops(backend, p, decode_only)
        errs.append(max(m["shrink_err"], m["expand_err"], m["apply_err"]))
    return VerifierResult("pass", f"rank {top} (+ rank {low}) correct on both paths ({name}, max err {max(errs):.2g}); rank {above} refused "
                                  "by the adapter gate and as the engine's max_lora_rank", {"max_err": max(errs)})
