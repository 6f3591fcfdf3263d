"""Verifiers for capabilities every backend declares unsupported today: int8 base, DoRA.

Declared unsupported (the normal case): the runtime must refuse them with an error that
quotes the matrix (DoRA: ``check_adapter`` on an adapter with ``use_dora``). Declared
supported: there is nothing in this runtime to run, so the verifier fails and says so.
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
    raise VerificationFailure(
        "declared supported, but this runtime has no int8 weight-only base to check; "
        "declare it supported together with a verifier that runs it (issue 9)"
    )


@verifier("dora", refusal=dora_refused)
def verify_dora(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    raise VerificationFailure("declared supported, but no backend implements DoRA's magnitude vector")
