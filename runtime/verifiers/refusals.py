"""Verifiers for the int8 weight-only base and DoRA.

int8 base, declared supported: ``runtime.quant.capability.check_int8_base`` on the backend.
Declared unsupported: the runtime must refuse it with an error that quotes the matrix
(DoRA: ``check_adapter`` on an adapter with ``use_dora``; DoRA declared supported fails,
since no backend implements its magnitude vector).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.capabilities import Capability, CapabilityError, CapabilityMatrix, check_adapter
from runtime.verifiers.result import VerificationFailure, VerifierResult, verifier


@dataclass(frozen=True)
class DoraModule:
    rank: int


@dataclass(frozen=True)
class DoraAdapter:
    """The attributes of a LoRAAdapter the gate reads, with ``use_dora`` set."""

    name: str = "probe-dora"
    max_rank: int = 8
    use_dora: bool = True
    modules: dict = field(default_factory=lambda: {(0, "q_proj"): DoraModule(8)})


def dora_refused(entry: Capability, matrix: CapabilityMatrix) -> str:
    try:
        check_adapter(DoraAdapter(), entry.backend, matrix)
    except CapabilityError as err:
        return str(err)
    raise VerificationFailure("declared unsupported, but an adapter with use_dora=True was accepted")


@verifier("quantized_base_int8")
def verify_quantized_base_int8(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    """int8 base linear + mixed-rank float LoRA + no-adapter rows vs float64, per declared dtype."""
    import torch

    from runtime.quant.capability import check_int8_base

    names = entry.limits.dtypes or ("float32",)
    try:
        figures = check_int8_base(backend, dtypes=tuple(getattr(torch, n) for n in names))
    except AssertionError as err:
        raise VerificationFailure(str(err)) from err
    detail = ", ".join(f"{k.removeprefix('rel_err_')}={v:.1e}" for k, v in figures.items())
    return VerifierResult("pass", f"int8 base + mixed-rank float LoRA vs float64, relative max err: {detail}", figures)


@verifier("dora", refusal=dora_refused)
def verify_dora(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    raise VerificationFailure("declared supported, but no backend implements DoRA's magnitude vector")
