"""The dense base GEMM ``y = x @ W^T (+ b)``, on the fastest kernel torch has for the operands.

For float32 on the CPU that is oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, the op
torch's Inductor compiler emits for CPU linears) once the weight is large; ``F.linear`` calls
MKL's sgemm. On the 2-core AMD EPYC dev machine (``python benchmarks/cpu_gemm.py --hidden H``;
docs/benchmarks.md), for the 16 projections of a 4-layer llama:

- hidden 512: oneDNN 2.4 / 4.1 / 6.0 / 27 ms for 1 / 11 / 32 / 256 rows, MKL 4.4 / 7.5 / 9.4 / 37 ms;
- hidden 64: oneDNN 0.29 ms for 1 row against 0.06 ms. It pays ~18 us a call whatever the size,
  so small weights stay on ``F.linear``: the cut is ``ONEDNN_MIN_WEIGHT`` elements (2^18, a
  512 x 512 matrix; at hidden 384 every projection was faster on oneDNN, at 256 only some).

Everything else (GPU tensors, other dtypes, a torch built without oneDNN) goes to ``F.linear``.
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


def dense_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x`` [..., in] @ ``weight`` [out, in]^T (+ ``bias`` [out]) -> [..., out]."""
    if ONEDNN_LINEAR and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and weight.numel() >= ONEDNN_MIN_WEIGHT:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
