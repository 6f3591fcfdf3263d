"""One verifier per capability: ``verify_<capability>(backend_name, matrix=None) -> VerifierResult``.

``lorafleet probe`` and tests/test_capabilities.py both call these functions, so the
matrix, the tests and the probe cannot drift apart. ``VERIFIERS`` is the registry; a
test fails when a capability in the matrix has no verifier here, or the reverse.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

from runtime.capabilities import CapabilityMatrix, CapabilityMatrixError, load_matrix
from runtime.verifiers.attention import verify_paged_attention, verify_prefix_caching
from runtime.verifiers.cuda_graph import verify_cuda_graph_safety
from runtime.verifiers.dtypes import verify_dtypes
from runtime.verifiers.lora_ops import (
    verify_lora_ops_per_token,
    verify_lora_ops_segment,
    verify_mixed_ranks,
    verify_multi_slice_expand,
)
from runtime.verifiers.max_rank import verify_max_rank
from runtime.verifiers.refusals import verify_dora, verify_quantized_base_int8
from runtime.verifiers.result import VerifierResult

Verifier = Callable[..., VerifierResult]

VERIFIERS: MappingProxyType[str, Verifier] = MappingProxyType(
    {
        v.capability: v  # type: ignore[attr-defined]
        for v in (
            verify_lora_ops_segment,
            verify_lora_ops_per_token,
            verify_mixed_ranks,
            verify_multi_slice_expand,
            verify_dtypes,
            verify_max_rank,
            verify_paged_attention,
            verify_prefix_caching,
            verify_cuda_graph_safety,
            verify_quantized_base_int8,
            verify_dora,
        )
    }
)


def run_all(
    backend_name: str, matrix: CapabilityMatrix | None = None, backend: object = None, progress: Callable[[int, int, str], None] | None = None
) -> dict[str, VerifierResult]:
    """Every capability of ``backend_name``'s section, in matrix order (``backend``: see ``verifier``),
    then a failure for each capability the runtime checks that the section leaves out.
    ``progress(i, n, capability)`` is called before the i-th (from 1) of n verifiers runs."""
    m = matrix or load_matrix()
    results = {}
    capabilities = list(m.capabilities(backend_name))
    for i, capability in enumerate(capabilities, 1):
        if progress is not None:
            progress(i, len(capabilities), capability)
        verify = VERIFIERS.get(capability)
        if verify is None:
            results[capability] = VerifierResult("fail", f"no verifier registered for {capability!r} (runtime/verifiers)")
        else:
            try:
                results[capability] = verify(backend_name, m, backend)
            except CapabilityMatrixError as err:  # it reads an entry the section leaves out
                results[capability] = VerifierResult("fail", f"cannot be checked with this matrix: {err}")
    for capability in VERIFIERS:  # every capability the probe verifies must be declared, supported or not
        if capability not in results:
            results[capability] = VerifierResult("fail", f"not declared: {m.path.name} has no {backend_name}.{capability} entry")
    return results


__all__ = ["VERIFIERS", "VerifierResult", "run_all"]
