"""Verifier for the declared dtypes: each one must be accepted by the engine config, and
round-trip through the LoRA ops (both paths) and attention with outputs in that dtype
and within that dtype's tolerance of float64. A dtype this very device lacks
(``backend.dtype_problem``, e.g. bfloat16 on an Atlas 310P card) must instead be refused
by the engine's gate; the result names it, and its ops are not run."""
from __future__ import annotations

from typing import Any

import torch

from runtime.capabilities import Capability, CapabilityError, CapabilityMatrix, Gate
from runtime.config import ConfigError, EngineConfig
from runtime.verifiers.attention_problem import check_attention, random_cache, random_step
from runtime.verifiers.lora_problem import build_problem, check_lora_ops
from runtime.verifiers.result import VerificationFailure, VerifierResult, verifier
from runtime.verifiers.sampling import fresh_seed, pick_ranks, torch_dtype


@verifier("dtypes")
def verify_dtypes(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    errs = {}
    refused = {}
    problem = getattr(backend, "dtype_problem", None)
    ops = matrix.entry(entry.backend, "lora_ops_segment").limits
    for name in entry.limits.dtypes or ():
        try:
            EngineConfig(model="probe", dtype=name)
        except ConfigError as err:
            raise VerificationFailure(f"dtype {name}: the engine refuses it: {err}") from err
        why = problem(name) if problem is not None else None
        if why:
            try:
                Gate(entry.backend, matrix).check_device_dtype(backend, name)
            except CapabilityError:
                refused[name] = why
                continue
            raise VerificationFailure(f"dtype {name}: the device lacks it ({why}) but the engine's gate lets it through")
        dtype = torch_dtype(name)
        seed = fresh_seed()
        ranks = pick_ranks(ops, 3, seed)
        worst = 0.0
        for decode_only in (False, True):
            p = build_problem(backend.device, dtype, ranks, (32,), 32, seed)
            m = check_lora_ops(backend, p, decode_only)
            worst = max(worst, m["shrink_err"], m["expand_err"], m["apply_err"])
        g = torch.Generator().manual_seed(seed)
        cache = random_cache(8, dtype, backend.device, g)
        step = random_step([3, 1], [3, 6], [[5, 1], [0, 7]], dtype, backend.device, g)
        worst = max(worst, check_attention(backend, step, cache, dtype, f"{name} seed {seed}")["max_abs_err"])
        errs[name] = worst
    if not errs:
        raise VerificationFailure(f"{entry.key}: no declared dtype runs on this device" if refused else f"{entry.key}: declares no dtypes")
    detail = "config + LoRA ops + attention; max err " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items())
    if refused:
        detail += "; refused on this device: " + ", ".join(refused)
    return VerifierResult("pass", detail, {"max_err": errs, "refused_on_device": refused})
