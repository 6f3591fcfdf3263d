"""The check behind capability ``quantized_base_int8``: an int8 base linear plus float LoRA on a backend.

``check_int8_base(backend)`` builds a fused q/k/v-style projection with int8 weights
(``quantize_int8``), two adapters of different ranks and rows with no adapter, runs
``LoRALinear.forward`` through the backend's LoRA ops, and compares with float64:

    y_ref[t] = x[t] @ (q * s)^T + scale_{slot(t)} * (x[t] @ A^T) @ B^T        (no delta where slot = -1)

It raises ``AssertionError`` naming the dtype when the relative error exceeds the
tolerance, and returns the figures otherwise. A capability verifier (runtime/verifiers)
calls it for a backend that declares ``quantized_base_int8`` supported.
"""
from __future__ import annotations

from typing import Any

import torch

from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.layers import LoRALinear, fuse
from runtime.lora.slice_weights import LoRASliceWeights
from runtime.quant.int8 import Int8Weight, quantize_int8

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def check_int8_base(backend: Any, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16), seed: int = 0) -> dict[str, float]:
    """Relative max error per dtype of int8 base + float LoRA vs float64 (see module docstring)."""
    device = torch.device(backend.device)
    g = torch.Generator().manual_seed(seed)
    d_in, outs, ranks, slots = 64, (64, 32, 32), (4, 12), [0, -1, 1, 1, 0, -1, 1]
    w = [torch.randn(o, d_in, generator=g) / d_in**0.5 for o in outs]
    q = [quantize_int8(x) for x in w]
    for i, (wi, qi) in enumerate(zip(w, q)):  # the quantizer itself, against the float weight: |W - q s| <= s / 2 per row
        bound = qi.scale.float()[:, None] * 0.5 + wi.abs().amax(dim=1, keepdim=True) * 1e-6  # + float32 rounding of q * s
        err = (wi - qi.dequantize()).abs()
        if not (err <= bound).all() or not (qi.q.abs().amax(dim=1) == 127).all():
            raise AssertionError(f"quantized_base_int8: quantize_int8 of weight {i} is off the float weight by {float(err.max()):.3e} "
                                 f"(bound s/2 = {float(bound.max()):.3e}), or a row's largest code is not 127")  # fmt: skip
    lora = [[(torch.randn(r, d_in, generator=g), torch.randn(o, r, generator=g) * 0.1) for r in ranks] for o in outs]
    scales = (2.0, 0.5)
    x = torch.randn(len(slots), d_in, generator=g)
    ref = torch.cat([x.double() @ qi.dequantize().double().T for qi in q], dim=1)
    for t, s in enumerate(slots):
        if s >= 0:
            ref[t] += torch.cat([scales[s] * (x[t].double() @ lora[i][s][0].double().T) @ lora[i][s][1].double().T for i in range(len(outs))])
    figures = {}
    for dtype in dtypes:
        slices = []
        for i, o in enumerate(outs):
            sw = LoRASliceWeights.allocate(d_in, o, max_slots=2, row_capacity=sum(ranks), dtype=dtype, device=device)
            for s, (a, b) in enumerate(lora[i]):
                sw.write_slot(s, sum(ranks[:s]), a.to(dtype), b.to(dtype), scales[s])
            slices.append(sw)
        weight = fuse([Int8Weight(qi.q, qi.scale).to(device) for qi in q])
        lin = LoRALinear(weight, None, ("q_proj", "k_proj", "v_proj"), outs, slices)
        meta = LoRABatchMeta.build(slots, device, decode_only=True)
        workspace = torch.zeros(3, len(slots), max(ranks), dtype=torch.float32, device=device)
        y = lin.forward(x.to(device=device, dtype=dtype), backend.lora, meta, workspace)
        backend.synchronize()
        err = float((y.double().cpu() - ref).abs().max() / ref.abs().max())
        name = str(dtype).removeprefix("torch.")
        if not err <= TOLERANCE[dtype]:
            raise AssertionError(f"quantized_base_int8 {name}: relative error {err:.3e} exceeds {TOLERANCE[dtype]:.0e}")
        if not isinstance(lin.weight, Int8Weight) or lin.weight.q.dtype != torch.int8:
            raise AssertionError(f"quantized_base_int8 {name}: the base weight did not stay int8")
        figures[f"rel_err_{name}"] = err
    return figures
