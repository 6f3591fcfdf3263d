"""LoRA-aware linear layer over one fused base projection.

A fused projection stacks several HF linears along the output dim (q/k/v, or
gate/up, or a single one). Each stacked part is a *slice* with its own LoRA weights:

    y = x @ W^T (+ b)                                        one base GEMM for all rows
    y[t, o_i : o_i + n_i] += scale_{i,s} * (x[t] @ A_{i,s}^T) @ B_{i,s}^T    s = slot(t) != -1

The second line is ``runtime.backend_api.apply_lora`` (grouped shrink, then expand,
through the backend's ops), driven by the step's ``LoRABatchMeta``.

The base weight is either a float tensor or an ``Int8Weight`` (int8 weight-only base,
``runtime/quant/int8.py``): then the base GEMM is ``(x @ q^T) * s`` (float16: ``x @ (q * s)^T``) and the LoRA delta
stays float on top; the integer codes are never modified.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from runtime.backend_api import LoRAOps, apply_lora
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights
from runtime.models.dense import dense_linear
from runtime.quant.int8 import Int8Weight, fuse_int8, int8_linear


class LoRALinear:
    """A fused base linear (weight [sum n_i, in], float or int8, optional bias) plus one LoRA slice per part."""

    def __init__(
        self,
        weight: Tensor | Int8Weight,
        bias: Tensor | None,
        slice_names: Sequence[str],
        slice_sizes: Sequence[int],
        slices: Sequence[LoRASliceWeights],
    ) -> None:
        if not (len(slice_names) == len(slice_sizes) == len(slices)):
            raise ValueError("LoRALinear: slice_names, slice_sizes and slices must have one entry per slice")
        if sum(slice_sizes) != weight.shape[0]:
            raise ValueError(f"LoRALinear: slice sizes {list(slice_sizes)} do not add up to the weight's {weight.shape[0]} rows")
        for name, size, s in zip(slice_names, slice_sizes, slices):
            if s.in_features != weight.shape[1] or s.out_features != size:
                raise ValueError(f"LoRALinear: slice {name} is [{s.in_features} -> {s.out_features}], expected [{weight.shape[1]} -> {size}]")
        self.weight = weight
        self.bias = bias
        self.slice_names = tuple(slice_names)
        self.slices = list(slices)
        offsets = [0]
        for size in slice_sizes[:-1]:
            offsets.append(offsets[-1] + size)
        self.slice_offsets = tuple(offsets)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def forward(self, x: Tensor, ops: LoRAOps, meta: LoRABatchMeta, workspace: Tensor) -> Tensor:
        """``x`` [T, in] -> [T, out]: base GEMM, then every slice's LoRA delta in place."""
        if isinstance(self.weight, Int8Weight):
            y = int8_linear(x, self.weight, self.bias)
        else:
            y = dense_linear(x, self.weight, self.bias)
        apply_lora(ops, x, y, self.slices, meta, self.slice_offsets, workspace)
        return y

    def slice_index(self, name: str) -> int:
        return self.slice_names.index(name)

    def nbytes(self) -> int:
        weight = self.weight.nbytes() if isinstance(self.weight, Int8Weight) else self.weight.numel() * self.weight.element_size()
        return weight + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


def fuse(parts: Sequence[Tensor] | Sequence[Int8Weight]) -> Tensor | Int8Weight:
    """Stack HF linears along the output dim, so one GEMM serves them all."""
    if isinstance(parts[0], Int8Weight):
        if not all(isinstance(p, Int8Weight) for p in parts):
            raise ValueError("fuse: cannot stack int8 and float weights into one projection")
        return fuse_int8(parts)  # type: ignore[arg-type]
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=0).contiguous()
