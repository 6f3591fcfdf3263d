"""Verifier for the declared dtypes: each one must be accepted by the engine config, and
round-trip through the LoRA ops (both paths) and attention with outputs in that dtype
and within that dtype's tolerance of float64."""
from __future__ import annotations

from typing import Any

import torch

from runtime.capabilities import Capability, CapabilityMatrix
from runtime.config import ConfigError, EngineConfig
from runtime.verifiers.attention_problem import check_attention, random_cache, random_step
from runtime.verifiers.lora_problem import build_problem, check_lora_ops
from runtime.verifiers.result import VerificationFailure, VerifierResult, verifier
from runtime.verifiers.sampling import fresh_seed, pick_ranks, torch_dtype


@verifier("dtypes")
def verify_dtypes(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    errs = {}
    ops = matrix.entry(entry.backend, "lora_ops_segment").limits
    for name in entry.limits.dtypes or ():
        try:
            EngineConfig(model="probe", dtype=name)
        except ConfigError as err:
            raise VerificationFailure(f"dtype {name}: the engine refuses it: {err}") from err
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
        raise VerificationFailure(f"{entry.key}: declares no dtypes")
    return VerifierResult("pass", "config + LoRA ops + attention; max err " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items()), {"max_err": errs})
