"""What a verifier returns, and the wrapper every verifier shares.

A verifier checks one capability of one backend on this machine:

    backend absent                 -> skipped, with the backend's one-line availability reason
    capability declared supported  -> the capability's real check (pass / fail)
    capability declared unsupported-> pass only if the runtime refuses it with a clear error
                                      quoting the matrix entry
    ... and not applicable there   -> skipped, "not applicable": for a capability no code path
      (``refusal=NOT_APPLICABLE``)    on that backend could ask for (cuda_graph_safety: nothing in
                                      the runtime captures CUDA graphs), so there is no refusal to
                                      check, and a "pass" would vouch for nothing
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import backends
from runtime.capabilities import Capability, CapabilityError, CapabilityMatrix, load_matrix, require

STATUSES = ("pass", "fail", "skipped")


@dataclass(frozen=True)
class VerifierResult:
    status: str  # pass | fail | skipped
    detail: str
    metrics: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"VerifierResult.status: {self.status!r} is not one of {', '.join(STATUSES)}")


class VerificationFailure(AssertionError):
    """Raised inside a check when the backend disagrees with what the matrix declares."""


Body = Callable[[Any, Capability, CapabilityMatrix], VerifierResult]
Refusal = Callable[[Capability, CapabilityMatrix], str]
NOT_APPLICABLE = None  # ``verifier(..., refusal=NOT_APPLICABLE)``: declared unsupported -> skipped, not pass


# Capabilities every engine uses (prefix caching: one that enables it): the engine's config gate
# (``check_engine_config``, which ``LLMEngine`` runs at start) refuses them when declared unsupported.
ENGINE_GATED = ("dtypes", "lora_ops_segment", "lora_ops_per_token", "paged_attention", "max_rank", "multi_slice_expand", "prefix_caching")


def probe_engine_config(backend: str, matrix: CapabilityMatrix, **overrides: Any) -> Any:
    """An ``EngineConfig`` for ``backend`` within its section's declared limits (its first dtype,
    ``max_lora_rank`` <= max_rank, ``max_loras`` and the token budget within the LoRA op rows), so
    that the engine's config gate refuses only what a check asks it about."""
    from runtime.capabilities import LORA_OP_CAPABILITIES
    from runtime.config import EngineConfig

    def limits(capability: str) -> Any:
        return matrix.entry(backend, capability).limits

    values: dict[str, Any] = {"model": "lorafleet-probe", "device": backend}
    if limits("dtypes").dtypes:
        values["dtype"] = limits("dtypes").dtypes[0]
    if limits("max_rank").max_rank is not None:
        values["max_lora_rank"] = min(64, limits("max_rank").max_rank)
    caps = [limits(c).max_adapters_per_batch for c in LORA_OP_CAPABILITIES if limits(c).max_adapters_per_batch is not None]
    rows = [limits(c).max_rows_per_launch for c in LORA_OP_CAPABILITIES if limits(c).max_rows_per_launch is not None]
    if caps:
        values["max_loras"] = min(8, *caps)
    if rows:
        values["max_num_batched_tokens"] = min(rows)
    values.update(overrides)
    return EngineConfig(**values)


def refused_by_runtime(entry: Capability, matrix: CapabilityMatrix) -> str:
    """The runtime's own gate must refuse an unsupported capability, quoting its entry: the engine's
    config gate for what every engine uses (``ENGINE_GATED``), the adapter gate for mixed ranks
    (modules of two ranks in one adapter; a mix across adapters is not gated), and ``require`` for
    the int8 base, which the model runner calls on loading an int8 checkpoint. (It only called
    ``require``, which refuses every unsupported entry: a check that could not fail.)"""
    from runtime.capabilities import check_adapter, check_engine_config
    from runtime.verifiers.gate_adapter import GateAdapter

    if entry.name in ENGINE_GATED:
        config = probe_engine_config(entry.backend, matrix, enable_prefix_caching=entry.name == "prefix_caching")
        where = "the engine's config gate (check_engine_config)"

        def attempt() -> object:
            return check_engine_config(config, entry.backend, matrix)
    elif entry.name == "mixed_ranks":
        where = "the adapter gate (check_adapter) on an adapter with modules of ranks 4 and 8"

        def attempt() -> object:
            return check_adapter(GateAdapter("probe-mixed-ranks", {(0, "q_proj"): 4, (0, "v_proj"): 8}), entry.backend, matrix)
    elif entry.name == "quantized_base_int8":
        where = "require(), the model runner's check on an int8 checkpoint"

        def attempt() -> object:
            return require(entry.name, entry.backend, matrix)
    else:
        raise VerificationFailure(f"declared unsupported, but the probe knows no place where the runtime refuses {entry.name}")
    try:
        attempt()
    except CapabilityError as err:
        if entry.quote() not in str(err):
            raise VerificationFailure(f"{where} refused, but for another entry than {entry.key}: {err}") from err
        return f"{where}: {err}"
    raise VerificationFailure(f"declared unsupported, but {where} did not refuse it")


def verifier(capability: str, refusal: Refusal | None = refused_by_runtime) -> Callable[[Body], Callable[..., VerifierResult]]:
    """Wrap ``body(backend, entry, matrix)`` into ``verify(backend_name, matrix=None)``.
    ``refusal``: how a backend that declares the capability unsupported must refuse it (its
    ``how`` attribute, if any, is shown); ``NOT_APPLICABLE``: such a backend reports skipped."""

    def wrap(body: Body) -> Callable[..., VerifierResult]:
        @functools.wraps(body)
        def verify(backend_name: str, matrix: CapabilityMatrix | None = None, backend: Any = None) -> VerifierResult:
            """``backend``: an instance to check instead of ``backends.get_backend(backend_name)``
            (tests pass e.g. the npu backend over an op emulation); then availability is not asked."""
            m = matrix or load_matrix()
            entry = m.entry(backend_name, capability)
            if backend is None:
                available, reason = backends.availability(backend_name)
                if not available:
                    return VerifierResult("skipped", reason)
            elif getattr(backend, "name", backend_name) != backend_name:
                raise ValueError(f"verify {capability}: backend {backend.name!r} given for section {backend_name!r}")
            start = time.perf_counter()
            try:
                if not entry.supported and refusal is NOT_APPLICABLE:
                    if entry.verified_on.how != "not applicable":
                        raise VerificationFailure(f"nothing can ask for {entry.key} on this backend, so there is nothing to verify, "
                                                  f"but the matrix says verified_on.how: {entry.verified_on.how} (use: not applicable)")
                    result = VerifierResult("skipped", f"not applicable: declared unsupported ({entry.note}); nothing on this "
                                            "backend can ask for it, so there is no refusal to check", {"not_applicable": True})
                elif not entry.supported:
                    message = refusal(entry, m)
                    if entry.note not in message:
                        raise VerificationFailure(f"the refusal does not quote the matrix note {entry.note!r}: {message}")
                    how = getattr(refusal, "how", "by the runtime's own gate")
                    result = VerifierResult("pass", f"refused as declared ({how}), quoting the matrix: {entry.note}", {"refusal": message})
                else:
                    result = body(backend if backend is not None else backends.get_backend(backend_name), entry, m)
            except VerificationFailure as err:
                result = VerifierResult("fail", str(err))
            except Exception as err:  # the backend raised: that is this capability's failure, reported, not hidden
                result = VerifierResult("fail", f"{type(err).__name__}: {err}")
            metrics = dict(result.metrics)
            metrics["verifier_ms"] = round((time.perf_counter() - start) * 1e3, 2)
            return VerifierResult(result.status, result.detail, metrics)

        verify.capability = capability  # type: ignore[attr-defined]
        return verify

    return wrap
