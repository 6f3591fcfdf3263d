"""The dense base GEMM ``y = x @ W^T (+ b)``, on the fastest kernel torch has for the operands.

For float32 on the CPU that is oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, the op
torch's Inductor compiler emits for CPU linears) once the weight is large; ``F.linear`` calls
MKL's sgemm. On the 2-core AMD EPYC dev machine (``python benchmarks/cpu_gemm.py --hidden H``;
docs/benchmarks.md), for the 16 projections of a 4-layer llama:

- hidden 512: oneDNN 1.8 / 4.0 / 5.8 / 14.6 ms for 1 / 11 / 32 / 128 rows, MKL 3.8 / 5.4 / 7.5 / 17.9 ms;
- hidden 64: oneDNN 0.29 ms for 1 row against 0.06 ms. It pays ~18 us a call whatever the size,
  so small weights stay on ``F.linear``: the cut is ``ONEDNN_MIN_WEIGHT`` elements (2^18, a
  512 x 512 matrix; at hidden 384 every projection was faster on oneDNN, at 256 only some).

oneDNN builds a kernel ("primitive") per shape and keeps 1024 of them by default; a new one cost
~0.2 ms here. So only steps of at most ``ONEDNN_MAX_ROWS`` (128) rows take it, which bounds the
shapes a server ever asks for (rows x a handful of weight shapes) well inside that cache, and
covers the decode steps a server spends most of its steps on; longer prefill steps stay on MKL.
A bias that is not one contiguous [out] vector also stays on ``F.linear``: the oneDNN op reads
the bias's memory as if it were contiguous (a strided or broadcast bias gives wrong sums).

Everything else goes to ``F.linear``: GPU tensors, other dtypes, a torch built without oneDNN or
with it switched off (``torch.backends.mkldnn.flags(enabled=False)``), and tensors that need
gradients (the oneDNN op has no backward).
The two differ by float rounding only (~3e-6 relative on those shapes); neither gives a row the
same bits in every batch size (both round a 1-row product differently from the same row among
others), so this changes no guarantee. The comparisons with transformers + PEFT (greedy tokens,
fp32) hold on either kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
ONEDNN_MIN_WEIGHT = 1 << 18  # elements: smaller weights are faster on F.linear (oneDNN's per-call cost)
ONEDNN_MAX_ROWS = 128  # rows of x: more go to F.linear (bounds the shapes oneDNN must build kernels for)


def dense_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x`` [..., in] @ ``weight`` [out, in]^T (+ ``bias`` [out]) -> [..., out]."""
    if _takes_onednn(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _takes_onednn(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    return (
        ONEDNN_LINEAR
        and torch.backends.mkldnn.enabled  # torch.backends.mkldnn.flags(enabled=False) turns it off
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.numel() >= ONEDNN_MIN_WEIGHT  # so x.shape[-1] = in >= 1
        and x.numel() <= ONEDNN_MAX_ROWS * x.shape[-1]
        and (bias is None or (bias.is_contiguous() and bias.shape == weight.shape[:1] and not bias.requires_grad))
        and not (x.requires_grad or weight.requires_grad)  # the op has no backward
    )
