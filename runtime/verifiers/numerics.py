"""Tolerances and comparisons against float64 references.

An output ``o`` matches its float64 reference ``r`` in dtype ``d`` when, elementwise,

    |o - r| <= tol_d * (1 + m),     tol_d = max(2 * eps(d), 1e-5)

where ``m`` is the magnitude of the terms that were summed (e.g. ``|y0| + s|h| @ |B|^T``
for expand; ``|r|`` when not given): rounding error scales with the terms, not with a
result that may cancel to ~0. tol_d allows a few roundings in the output dtype, and
float32-accumulation noise for float32. Inputs are O(1), so the bound is meaningful.

That bound also admits summing the terms in the compute dtype itself: a half-precision
running sum errs by ~eps(d) * |partial sums| <= eps(d) * m. ``result_magnitude`` gives the
bound a check uses when the terms cancel (|r| << m) and every value is exact in d, so the
only rounding an fp32-accumulating op may add is the result's own:

    |o - r| <= tol_d * (1 + |r|) + 2 * eps(float32) * m
"""
from __future__ import annotations

import torch
from torch import Tensor

from runtime.verifiers.result import VerificationFailure


def tolerance(dtype: torch.dtype) -> float:
    if not dtype.is_floating_point:
        raise VerificationFailure(f"{dtype} is not a floating-point dtype: LoRA deltas and attention cannot be represented")
    return max(2.0 * torch.finfo(dtype).eps, 1e-5)


def compare(what: str, out: Tensor, ref: Tensor, dtype: torch.dtype, scale: float = 1.0,
            magnitude: Tensor | None = None, m: str = "|terms|") -> dict[str, float]:
    """Check ``out`` against the float64 ``ref``; returns error figures, raises on a mismatch.

    ``scale`` widens the tolerance for ops with more rounding steps (softmax chains);
    ``magnitude`` is ``m`` of the module docstring (default ``|ref|``), described as ``m`` in the error.
    """
    tol = tolerance(dtype) * scale
    o = out.detach().to("cpu", torch.float64)
    if o.shape != ref.shape:
        raise VerificationFailure(f"{what}: shape {tuple(o.shape)} != expected {tuple(ref.shape)}")
    if not torch.isfinite(o).all():
        raise VerificationFailure(f"{what}: {int((~torch.isfinite(o)).sum())} non-finite values")
    err = (o - ref).abs()
    mag = ref.abs() if magnitude is None else magnitude
    m = "|ref|" if magnitude is None else m
    ratio = float((err / (tol * (1 + mag))).max()) if err.numel() else 0.0
    max_abs = float(err.max()) if err.numel() else 0.0
    if ratio > 1.0:
        raise VerificationFailure(f"{what}: max abs error {max_abs:.3g} exceeds tolerance {tol:.3g}*(1+{m}) ({ratio:.2f}x)")
    return {"max_abs_err": max_abs, "tol_used": ratio}


def result_magnitude(ref: Tensor, terms: Tensor, dtype: torch.dtype) -> Tensor:
    """``magnitude`` for ``compare`` that puts the tolerance on the result (module docstring):
    ``|ref| + (2 eps(float32) / tol_d) * terms``."""
    return ref.abs() + (2.0 * torch.finfo(torch.float32).eps / tolerance(dtype)) * terms


def unchanged(what: str, after: Tensor, before: Tensor) -> None:
    """Entries the op must not touch are bit-identical (poisoned outputs catch stray writes)."""
    a, b = after.detach().cpu(), before.detach().cpu()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if not bool(same.all()):
        raise VerificationFailure(f"{what}: {int((~same).sum())} entries changed that the op must leave untouched")
