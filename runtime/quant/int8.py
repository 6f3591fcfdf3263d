"""int8 weight-only quantization with symmetric per-output-channel scales.

For a linear weight ``W [out, in]`` (float32 math):

    s[o]    = max_i |W[o, i]| / 127            (s[o] = 1 where that is 0 in float32: an all-zero row, or one
                                                whose quotient underflows, max|W| < ~9e-44; its codes are all 0)
    q[o, i] = clamp(round(W[o, i] / s[o]), -127, 127)   stored as int8
    W~      = q * s[:, None]                    (dequantize)
    |W - W~| <= s[o] / 2 elementwise            (round-to-nearest; the clamp never bites since |W/s| <= 127)

The runtime keeps ``q`` int8 in memory and computes, per matmul,

    y = (x @ q^T) * s (+ b)                     q cast to x's dtype for that one matmul
                                                (float16: x @ (q * s)^T, see int8_linear)

which equals ``x @ W~^T`` up to float rounding; LoRA deltas stay float on top.

Checkpoint format (``lorafleet quantize`` writes it, ``runtime/models/loader.py`` reads it):

* only the seven LoRA-targetable projections (``q/k/v/o_proj``, ``gate/up/down_proj``)
  are quantized; embeddings, ``lm_head``, norms and biases stay float;
* ``<module>.weight``        int8    [out, in]  the codes ``q``
* ``<module>.weight_scale``  float32 [out]      the scales ``s``
* ``config.json`` gains ``"quantization_config": {"quant_method": "lorafleet-int8-wo",
  "bits": 8, "group": "per-output-channel"}``. transformers does not know this
  method, so such a folder loads only with lorafleet.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

QUANT_METHOD = "lorafleet-int8-wo"
QUANTIZATION_CONFIG: Mapping[str, Any] = {"quant_method": QUANT_METHOD, "bits": 8, "group": "per-output-channel"}
SCALE_SUFFIX = "_scale"  # "<module>.weight" -> "<module>.weight_scale"
QMAX = 127
_PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")


class QuantizationConfigError(ValueError):
    """config.json's quantization_config names a scheme lorafleet cannot load; names the file and field."""


def is_quantized_projection(name: str) -> bool:
    """True for the HF weight names this scheme quantizes (the seven projections of every layer)."""
    return _PROJECTION.match(name) is not None


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def quantization_scheme(raw_config: Mapping[str, Any], path: Any) -> Mapping[str, Any] | None:
    """``config.json``'s ``quantization_config``: None for a float checkpoint, the scheme for ours, else an error."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantizationConfigError(f"{path}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise QuantizationConfigError(
            f"{path}: quantization_config.quant_method {method!r} is not supported; lorafleet loads only {QUANT_METHOD!r} "
            "(write one with `lorafleet quantize`)"
        )
    for key, want in QUANTIZATION_CONFIG.items():
        if qc.get(key) != want:
            raise QuantizationConfigError(f"{path}: quantization_config.{key} is {qc.get(key)!r}; {QUANT_METHOD} needs {want!r}")
    return dict(qc)


@dataclass(frozen=True)
class Int8Weight:
    """A quantized linear weight: codes ``q`` int8 [out, in] and scales ``scale`` float32 [out]."""

    q: Tensor
    scale: Tensor

    def __post_init__(self) -> None:
        if self.q.dtype != torch.int8 or self.q.dim() != 2:
            raise ValueError(f"Int8Weight.q: expected a 2-D int8 tensor, got {self.q.dtype} {tuple(self.q.shape)}")
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (self.q.shape[0],):
            raise ValueError(f"Int8Weight.scale: expected float32 [{self.q.shape[0]}], got {self.scale.dtype} {tuple(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_int8(self.q, self.scale).to(dtype)

    def to(self, device: torch.device) -> "Int8Weight":
        return Int8Weight(self.q.to(device), self.scale.to(device))


def quantize_int8(weight: Tensor) -> Int8Weight:
    """``W [out, in]`` (any float dtype) -> codes and per-row scales, computed in float32 (see module docstring)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_int8: expected a 2-D float weight, got {weight.dtype} {tuple(weight.shape)}")
    w = weight.float()
    if not torch.isfinite(w).all():
        raise ValueError("quantize_int8: the weight contains NaN or Inf")
    scale = w.abs().amax(dim=1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # tested after the division: it can underflow to 0
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """``q * s[:, None]`` in float32."""
    return q.float() * scale.float()[:, None]


def int8_linear(x: Tensor, weight: Int8Weight, bias: Tensor | None = None) -> Tensor:
    """``y = (x @ q^T) * s (+ b)``: q is cast to x's dtype for this matmul only; it stays int8 in memory.

    float16 instead computes ``x @ (q * s)^T``, the weight dequantized first: ``x @ q^T`` is about
    ``1 / s`` (often 100-1000x) larger than ``y`` and overflows float16's 65504 on an outlier
    activation, and a small ``s`` flushes to zero in float16. float32 and bfloat16 have the range.
    """
    if x.dtype == torch.float16:
        return F.linear(x, weight.dequantize(torch.float16), bias)
    y = F.linear(x, weight.q.to(x.dtype)) * weight.scale.to(x.dtype)
    return y if bias is None else y + bias


def fuse_int8(parts: Sequence[Int8Weight]) -> Int8Weight:
    """Stack quantized linears along the output dim (scales are per output row, so they stack too)."""
    if len(parts) == 1:
        return parts[0]
    return Int8Weight(torch.cat([p.q for p in parts]).contiguous(), torch.cat([p.scale for p in parts]).contiguous())
