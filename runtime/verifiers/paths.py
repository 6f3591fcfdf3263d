"""Which implementation served a check: the primary one, or the declared fallback.

A numerical check alone cannot tell which implementation produced a result, and a
problem that quietly falls outside the primary implementation's limits verifies only the
fallback. A backend with declared fallbacks counts every fallback it takes, by reason
(``backend.fallbacks.counts``: backends/ascend/fallback_log.py). ``FallbackWatch`` reads the
reasons noted inside its ``with`` block, so a verifier can require

    a problem inside the primary limits   -> apply_lora noted no fallback (or only those this
                                             chip takes there: chip_fallback_reasons)
    a case run for the fallback           -> it noted the fallback's reason, and only that

``forced_fallback(backend)`` builds the backend that takes its fallback for every call, with
no device op reachable: for npu, the same device with a SoC name torch_npu's docs promise
nothing for (the declared "SoC neither Atlas A2 nor 310P" condition), and a stand-in for
torch_npu whose every op raises. A backend with no recipe here cannot have its declared
fallback verified, and the verifier says so.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from runtime.verifiers.result import VerificationFailure

OUTSIDE_THE_DOCS_SOC = "Ascend910_93"  # Atlas A3: neither Atlas A2 nor 310P (backends/ascend/soc.py)


class FallbackWatch:
    """``with FallbackWatch(backend) as w: ...`` then ``w.taken``: reason -> fallbacks noted in the
    block (empty when none); ``w.observable`` is False for a backend that keeps no fallback log."""

    def __init__(self, backend: Any) -> None:
        log = getattr(backend, "fallbacks", None)
        self._counts = getattr(log, "counts", None)
        self.observable = self._counts is not None
        # Reasons this chip takes inside the matrix's primary limits (AscendBackend.chip_fallback_reasons):
        # there a primary case is served by the declared fallback, which is what the matrix says.
        self.chip_reasons: frozenset[str] = frozenset(getattr(backend, "chip_fallback_reasons", frozenset()))
        self.taken: Counter[str] = Counter()

    def __enter__(self) -> "FallbackWatch":
        self._before = Counter(self._counts or {})
        return self

    def __exit__(self, *exc: Any) -> None:
        self.taken += Counter(self._counts or {}) - self._before


class NoDeviceOps:
    """Stands in for the device's op library in a backend forced onto its fallback: the
    fallback must not call any op, so touching one fails the check."""

    def __init__(self, library: str) -> None:
        self._library = library

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise VerificationFailure(f"forced onto its fallback, the backend still used {self._library}.{name}")


def _npu_on_a_soc_outside_the_docs(backend: Any) -> Any:
    return type(backend)(device=backend.device, npu_ops=NoDeviceOps("torch_npu"), soc_name=OUTSIDE_THE_DOCS_SOC)


# backend name -> (build the forced backend, the fallback reasons it must note, how it was forced)
FORCED_FALLBACK: dict[str, tuple[Callable[[Any], Any], frozenset[str], str]] = {
    "npu": (_npu_on_a_soc_outside_the_docs, frozenset({"prefill:soc", "decode:soc"}),
            f"torch path: soc {OUTSIDE_THE_DOCS_SOC}, no torch_npu op reachable"),
}


def forced_fallback(backend: Any, capability: str) -> tuple[Any, frozenset[str], str]:
    """(backend forced onto its fallback, the reasons it notes, a label saying how)."""
    recipe = FORCED_FALLBACK.get(getattr(backend, "name", ""))
    if recipe is None:
        raise VerificationFailure(f"{backend.name}.{capability} declares a fallback, but runtime/verifiers/paths.py has no way to force "
                                  "this backend onto it, so the fallback cannot be verified")
    build, reasons, how = recipe
    return build(backend), reasons, how


def expect_path(watch_apply: FallbackWatch, tag: str, primary: bool, reasons: frozenset[str] | None = None) -> None:
    """``primary``: apply_lora took no fallback, or only the ones this chip takes inside the primary
    limits (``FallbackWatch.chip_reasons``). Else it took one, every reason in ``reasons`` (if given)."""
    if not watch_apply.observable:
        if primary:
            return  # no declared fallback to take: the primary implementation is all there is
        raise VerificationFailure(f"{tag}: the backend keeps no fallback log, so the case cannot confirm the fallback ran")
    taken = dict(watch_apply.taken)
    if primary and taken and not set(taken) <= watch_apply.chip_reasons:
        raise VerificationFailure(f"{tag}: inside the primary limits, apply_lora took the fallback {taken}, "
                                  "so this case did not verify the primary implementation")
    if not primary and not taken:
        raise VerificationFailure(f"{tag}: meant for the fallback, apply_lora noted no fallback, so the case did not verify it")
    if not primary and reasons is not None and not set(taken) <= reasons:
        raise VerificationFailure(f"{tag}: the forced fallback noted {taken}, expected only {sorted(reasons)}")
