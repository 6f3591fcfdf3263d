"""The dense base GEMM ``y = x @ W^T (+ b)``, on the fastest kernel torch has for the operands.

A weight stored packed (``pack_weight``: oneDNN's blocked layout) runs on oneDNN's linear
(``torch.ops.mkldnn._linear_pointwise``, the op torch's Inductor compiler emits for CPU linears);
every plain weight runs on ``F.linear`` (MKL's sgemm on x86 builds of torch). So the kernel is
chosen once, at load, by packing or not: ``EngineConfig.cpu_gemm`` ``onednn`` packs the large
float32 CPU projections, ``mkl`` keeps them plain, and ``auto`` (the default) packs them wherever
torch has oneDNN (``FLOAT32_ONEDNN``).

Why ``auto`` packs on every CPU. MKL takes its fastest code paths only on Intel CPUs, and on the
2-core Intel Xeon dev machine (2026-12-02, AVX-512; ``benchmarks/cpu_gemm.py`` and
``benchmarks/packed_weights.py``, docs/benchmarks.md "MKL or oneDNN for float32 on an Intel CPU")
it did beat packed oneDNN at hidden 512 (16 projections, 1 / 11 rows: 1.27 / 2.96 ms against 3.63 /
3.94; in the engine, stepped in turn, a lone request 1.31x and the 48-request burst 1.03-1.07x),
and for a lone request at hidden 1024 (1.23x). But on the bursts at hidden 1024 and 2048, the
batched decoding a multi-adapter server does, packed oneDNN was 1.06x and 1.08x faster (MKL lost at
11-128 rows: hidden 1024, 19.80 / 24.01 / 48.35 ms against 12.62 / 18.51 / 43.59), and on the AMD
EPYC dev machine packed oneDNN won at every size measured. ``mkl`` is the choice for a small model,
or a latency-bound single stream, on an Intel CPU. On the EPYC:

- hidden 512: oneDNN 1.8 / 4.0 / 5.8 / 14.6 ms for 1 / 11 / 32 / 128 rows, MKL 3.8 / 5.4 / 7.5 / 17.9 ms
  (plain weights; packed ones faster still, below);
- hidden 64: oneDNN 0.29 ms for 1 row against 0.06 ms. It pays ~18 us a call whatever the size,
  so small weights stay plain on ``F.linear``: the cut is ``ONEDNN_MIN_WEIGHT`` elements (2^18, a
  512 x 512 matrix; at hidden 384 every projection was faster on oneDNN, at 256 only some).

oneDNN builds a kernel ("primitive") per shape and keeps 1024 of them by default; a new one cost
~0.2 ms here. So it only ever sees calls of at most ``ONEDNN_MAX_ROWS`` (128) rows, which bounds
the shapes a server asks for (rows x a handful of weight shapes) well inside that cache: a packed
weight takes every call in chunks of at most 128 rows. Where the op cannot take a call on a packed
weight (oneDNN switched off by ``torch.backends.mkldnn.flags(enabled=False)``, tensors that need
gradients, which the op has no backward for, another dtype, a bias that is not one contiguous [out]
vector, whose memory the op would read as if it were), the weight is unpacked for that call and
the call goes to ``F.linear``. GPU tensors, small weights, float64/float16, and bf16 weights where
the CPU lacks native bf16 are never packed.

The two differ by float rounding only (~3e-6 relative on those shapes); neither gives a row the
same bits in every batch size (both round a 1-row product differently from the same row among
others), so this changes no guarantee. The comparisons with transformers + PEFT (greedy tokens,
fp32) hold on either kernel.

Packed weights (``pack_weight``). The op is faster given a weight already in oneDNN's own blocked
layout than given the plain ``[out, in]`` tensor, so a packed model stores each large projection
once in that layout (``torch.ops.mkldnn._reorder_linear_weight``, as Inductor's weight freezing
does), in place of the plain copy, so memory stays the same. For the 16 projections of the
hidden-512 llama on the EPYC (``benchmarks/cpu_gemm.py``; docs/benchmarks.md, "Packed weights") 11 /
32 / 128 rows took 2.75 / 4.58 / 13.40 ms packed against 3.72 / 5.52 / 14.61 on oneDNN with the
plain tensor (a path ``dense_linear`` took until 2026-12-02; plain weights now always take
``F.linear``); at hidden 1024 7.40 / 14.70 / 49.70 against 11.19 / 18.34 / 53.63. oneDNN's packed
kernels for 1-2 rows are slower than its 4-row one, so calls of 1-3 rows are zero-padded to
``PACKED_MIN_ROWS`` (4) rows. 512 rows in four 128-row chunks took 55.4 ms there, MKL 58.5.

bfloat16. Where oneDNN runs bf16 natively on this CPU (AVX512-BF16 or AMX:
``torch.ops.mkldnn._is_mkldnn_bf16_supported()``, ``PACKED_BFLOAT16``), large bf16 CPU projections are
packed the same way, with the same 4-128-row calls (``x``, bias and result in bf16, sums in float32,
as ``F.linear``'s), whatever ``cpu_gemm`` says. On the EPYC (``benchmarks/cpu_gemm.py --dtype bfloat16``) the 16 hidden-512
projections took 1.58 / 1.40 / 1.69 / 2.58 / 7.25 ms for 1 / 4 / 11 / 32 / 128 rows packed against
1.81 / 2.21 / 2.55 / 3.50 / 8.23 on ``F.linear``, but 512 rows (in 128-row calls) 0.91x of
``F.linear``; at hidden 1024, 1.06-1.72x. End to end (``benchmarks/packed_weights.py --dtype
bfloat16``, in turn, the same tokens) a lone request at hidden 1024 went 1.28x, the 48-request
burst 1.05x (hidden 1024) and 1.00x (hidden 512): there the GEMMs are a smaller share of a bf16 step
(torch's bf16 SDPA took 0.68 of 2.5 s in a hidden-1024 profile, the GEMMs 0.90). On the Xeon (AMX)
packed bf16 took 1.45 / 1.46 / 1.69 / 3.27 ms for 4 / 11 / 32 / 128 rows against ``F.linear``'s 1.61 /
1.65 / 1.96 / 3.61 (1 row 1.89 against 1.53, 512 rows 14.39 against 10.17), so bf16 stays packed
there (not compared end to end on that machine). ``cpu_gemm`` does not change bf16. Every bf16
weight where the CPU lacks native bf16 stays plain (oneDNN would convert on each call; not
measured), as does every float16 one (not measured).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.config import CPU_GEMMS  # EngineConfig.cpu_gemm: FLOAT32_ONEDNN's choice, or float32 packed / plain

ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
PACKED_WEIGHTS = ONEDNN_LINEAR and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# float32 packed for oneDNN under cpu_gemm "auto": wherever torch can pack (module docstring: batched decoding at real model
# sizes was faster packed on both CPUs measured; cpu_gemm "mkl" keeps float32 plain on F.linear instead).
FLOAT32_ONEDNN = PACKED_WEIGHTS
# bfloat16 weights are packed too where oneDNN runs bf16 natively on this CPU (AVX512-BF16 or AMX); elsewhere
# it would convert every call, and the weights stay plain on F.linear. float16 stays plain: not measured.
PACKED_BFLOAT16 = ONEDNN_LINEAR and bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
ONEDNN_MIN_WEIGHT = 1 << 18  # elements: smaller weights are faster on F.linear (oneDNN's per-call cost)
ONEDNN_MAX_ROWS = 128  # rows of x a oneDNN call: more are cut into chunks; bounds the kernel shapes
PACKED_MIN_ROWS = 4  # rows: fewer are zero-padded to this many on a packed weight (oneDNN's 1-2 row kernels are slower there)


def float32_packed(cpu_gemm: str) -> bool:
    """Whether float32 weights are packed for oneDNN under ``EngineConfig.cpu_gemm``: ``onednn`` yes,
    ``mkl`` no (plain, ``F.linear``), ``auto`` this CPU's choice (``FLOAT32_ONEDNN``, while oneDNN
    is switched on: ``torch.backends.mkldnn.enabled``)."""
    if cpu_gemm not in CPU_GEMMS:
        raise ValueError(f"cpu_gemm: {cpu_gemm!r} is not one of {', '.join(CPU_GEMMS)}")
    return (FLOAT32_ONEDNN and torch.backends.mkldnn.enabled) if cpu_gemm == "auto" else cpu_gemm == "onednn"


def why_onednn_cannot_pack() -> Optional[str]:
    """Why ``pack_weight`` would leave every weight plain on this torch now (so ``cpu_gemm`` onednn
    would change nothing), or None when it can pack."""
    if not PACKED_WEIGHTS:
        return "this torch build cannot pack weights for oneDNN (no mkldnn._linear_pointwise / _reorder_linear_weight)"
    if not torch.backends.mkldnn.enabled:
        return "oneDNN is switched off in this process (torch.backends.mkldnn.enabled is False)"
    return None


def pack_weight(weight: Tensor, *, float32: bool | None = None) -> Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout (a new tensor, ``is_mkldnn``, of the same
    dtype), for a CPU tensor of at least ``ONEDNN_MIN_WEIGHT`` elements that needs no gradient, on a
    torch with oneDNN switched on, that is float32 and ``float32`` says so (None: this CPU's
    choice, ``FLOAT32_ONEDNN``; True/False: ``float32_packed`` of an explicit ``cpu_gemm``), or
    bfloat16 where this CPU runs bf16 natively (``PACKED_BFLOAT16``). Anything else comes back as
    it is. Only ``dense_linear`` can multiply by a packed weight."""
    if not (PACKED_WEIGHTS and torch.backends.mkldnn.enabled and _packable(weight)):
        return weight
    if weight.dtype == torch.float32 and not (FLOAT32_ONEDNN if float32 is None else float32):
        return weight
    # The batch-size hint picks the blocking: 128, the largest call, timed at least as fast as none
    # or smaller hints at every row count from 1 to 128 (within 1-10%).
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_MAX_ROWS)


def dense_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x`` [..., in] @ ``weight`` [out, in]^T (+ ``bias`` [out]) -> [..., out]: oneDNN for a packed
    weight (``pack_weight``), ``F.linear`` for a plain one."""
    if weight.is_mkldnn:
        if not _onednn_operands(x, weight, bias):
            return F.linear(x, weight.to_dense(), bias)
        return _packed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _packed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``dense_linear`` on a packed weight for any shape of ``x``: its rows in calls of
    ``PACKED_MIN_ROWS`` to ``ONEDNN_MAX_ROWS`` rows (``packed_call_rows``), 1-3 rows padded."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if 0 < n < PACKED_MIN_ROWS:  # zero rows added, their outputs dropped
        y = torch.ops.mkldnn._linear_pointwise(F.pad(rows, (0, 0, 0, PACKED_MIN_ROWS - n)), weight, bias, "none", [], "").narrow(0, 0, n)
    elif n <= ONEDNN_MAX_ROWS:  # a decode step: one call
        y = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    else:
        y = torch.cat([torch.ops.mkldnn._linear_pointwise(c, weight, bias, "none", [], "") for c in rows.split(packed_call_rows(n))])
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


def packed_call_rows(n: int) -> list[int]:
    """How ``n`` > ``ONEDNN_MAX_ROWS`` rows are cut: full calls, and a last one of at least
    ``PACKED_MIN_ROWS`` rows (taken from the call before it when fewer are left over)."""
    sizes = [ONEDNN_MAX_ROWS] * (n // ONEDNN_MAX_ROWS) + ([n % ONEDNN_MAX_ROWS] if n % ONEDNN_MAX_ROWS else [])
    if len(sizes) > 1 and sizes[-1] < PACKED_MIN_ROWS:
        sizes[-2] -= PACKED_MIN_ROWS - sizes[-1]
        sizes[-1] = PACKED_MIN_ROWS
    return sizes


def _packable(weight: Tensor) -> bool:
    """A weight worth oneDNN's per-call cost: float32 (or natively supported bfloat16) on the
    CPU, large, needing no gradient. A plain one goes to oneDNN only in float32: for a plain
    bfloat16 weight the op was no faster than ``F.linear``."""
    return (
        ONEDNN_LINEAR
        and weight.device.type == "cpu"
        and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and PACKED_BFLOAT16))
        and weight.numel() >= ONEDNN_MIN_WEIGHT
        and not weight.requires_grad  # the op has no backward
    )


def _onednn_operands(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """The oneDNN op can take this call: switched on now, a CPU ``x`` of the weight's dtype
    needing no gradient, and no bias or one contiguous [out] vector of that dtype (another
    dtype gets ``F.linear``'s own error instead of the op's primitive-descriptor one, or, for a
    float32 bias on a bfloat16 weight, which the op would take, the same error as ``F.linear``)."""
    return (
        torch.backends.mkldnn.enabled  # torch.backends.mkldnn.flags(enabled=False) turns it off
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.shape[-1] == weight.shape[1]
        and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous() and bias.shape == weight.shape[:1] and not bias.requires_grad))
        and not x.requires_grad
    )
