"""Problems whose sums cancel, to check that the LoRA ops accumulate in float32 ("fp32 accumulate").

Against float64 with the tolerance on the terms (numerics.py), fp32 accumulation and a running
sum in the compute dtype d look alike: both err by at most ~eps(d) * sum |terms|. Here the terms
are large and the results small, and the tolerance is on the result
(``check_lora_ops(..., tight=True)``, ``numerics.result_magnitude``): summing in float32 and
rounding once to d passes, a running sum in d errs by ~eps(d) * |partial sums|, many times more.

``exact_h`` (every backend). With in = 2K, rank r = 2m and Q = {j/16 : |j| < 128}:

    x_t = [u_t, u_t + e_t]             u_t in Q^K, e_t = +-1 at one position k_t, 0 elsewhere
    A_j = A_{j+m} = [v_j, -v_j]        v_j in Q^K                            (j < m)
    h_{t,j} = h_{t,j+m} = -e_t . v_j   in Q: |h| < 8, while the K-sum's partial sums reach |u_t . v_j| ~ 64
    B[:, j] = W_j,  B[:, j+m] = -W_j + C_j     W_j in Q^out, C_j in {-2..2}/16
    delta_t = s * sum_j h_{t,j} C_j    s in {1/2, 1, 2}; the expand's terms s |h W| ~ 16 cancel to ~1

Every input and h have at most 8 significant bits (bf16 and fp16 hold them exactly) and every
float32 partial sum is exact, so rounding x, A, B or h to d, or folding s into B (npu), costs
nothing: only summing in d, or a wrong result, can fail.

``h_in_fp32`` (only where ``keeps_h_in_fp32``: the cpu backend, whose matrix rows say LoRA
"accumulates in float32 and casts once"; the cuda kernels on a GPU and the npu ops round h to d
between shrink and expand by design). x and A_j random (O(1)), and

    A_{j+m} = A_j + D_j   (|D| ~ 2^-6 |A|),    B[:, j] = -B[:, j+m] = W_j   (|W| ~ 16)
    delta_t = s * sum_j (h_{t,j} - h_{t,j+m}) W_j = -s * sum_j (x_t . D_j) W_j

so rounding h to d before the expand errs by ~eps(d) |h| |W| per term, far above the result's
rounding, while float32 h passes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from runtime.verifiers.lora_problem import LoRAProblem

STEP = 1.0 / 16  # Q's spacing; |values| < 8 keep 7 significant bits


def keeps_h_in_fp32(backend: Any) -> bool:
    """Whether ``backend.lora`` declares h kept in float32 between shrink and expand, and every
    result cast once (backends/reference.py: "LoRA accumulates in float32 and casts once")."""
    from backends.reference import ReferenceLoRAOps

    return isinstance(backend.lora, ReferenceLoRAOps)


def _q(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(-127, 128, shape, generator=g).double() * STEP


def cancelling(p: LoRAProblem, exact_h: bool) -> LoRAProblem:
    """``p``'s layout (rows, slots, packing, offsets) with the values of the module docstring,
    written into its weights; ``p`` needs an even in_features and even ranks."""
    g = torch.Generator().manual_seed(p.seed + 2)
    t, n_in = p.x.shape
    if n_in % 2 or any(r % 2 for ranks in p.ranks for r in ranks):
        raise ValueError(f"cancelling: needs even in_features and ranks, got {n_in} and {p.ranks}")
    k = n_in // 2
    d = p.dtype
    if exact_h:
        u = _q((t, k), g)
        e = torch.zeros(t, k, dtype=torch.float64)
        e[torch.arange(t), torch.randint(0, k, (t,), generator=g)] = torch.randint(0, 2, (t,), generator=g).double() * 2 - 1
        x = torch.cat([u, u + e], 1)
    else:
        x = p.x.detach().cpu().double()
    a64, b64, scales = [], [], []
    for i, w in enumerate(p.weights):
        a_i, b_i, s_i = {}, {}, {}
        for s, r in enumerate(p.ranks[i]):
            if r == 0:
                continue
            m = r // 2
            if exact_h:
                half = torch.cat([(v := _q((m, k), g)), -v], 1)
                a = torch.cat([half, half], 0)
                wj = _q((w.out_features, m), g)
                b = torch.cat([wj, -wj + torch.randint(-2, 3, (w.out_features, m), generator=g).double() * STEP], 1)
                scale = 2.0 ** int(torch.randint(-1, 2, (), generator=g))
            else:
                a0 = (torch.randn(m, n_in, generator=g, dtype=torch.float64) / n_in**0.5).to(d).double()
                a = torch.cat([a0, a0 + torch.randn(m, n_in, generator=g, dtype=torch.float64) / n_in**0.5 * 2**-6], 0)
                wj = (16 * torch.randn(w.out_features, m, generator=g, dtype=torch.float64)).to(d).double()
                b = torch.cat([wj, -wj], 1)
                scale = float(0.5 + 1.5 * torch.rand((), generator=g, dtype=torch.float64))
            a, b = a.to(d), b.to(d)
            w.write_slot(s, w.host_start[s], a.to(p.device), b.to(p.device), scale)
            a_i[s], b_i[s], s_i[s] = a.double(), b.double(), scale
        a64.append(a_i), b64.append(b_i), scales.append(s_i)
    return dataclasses.replace(p, x=x.to(d).to(p.device), a64=tuple(a64), b64=tuple(b64), scales=tuple(scales))
