"""The one contract between ``runtime/`` and ``backends/``.

runtime/ owns these interfaces; backends/ implement them. runtime/ never imports a
device backend by name: it asks ``backends.get_backend(name)``.

LoRA math, for every row t with slot s = meta.token_slots[t] != -1 and every slice i:

    shrink:  h[i, t, :r]   = x[t] @ A_{i,s}^T                    r = rank of s in slice i
    expand:  y[t, o_i:o_i+n_i] += scale_{i,s} * h[i, t, :r] @ B_{i,s}^T

with fp32 accumulation. Rows with slot -1, and slices where the slot's rank is 0,
are left untouched (shrink writes nothing, expand adds nothing). Entries of ``h``
beyond a row's rank are never read.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from runtime.kv.attention_meta import AttentionMeta
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights


@runtime_checkable
class LoRAOps(Protocol):
    def shrink(self, x: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, out: Tensor) -> None:
        """``out[i, t, :r] = x[t] @ A_{i,slot(t)}^T``; x: [T, in], out: [n_slices, T, >= max rank] float32."""
        ...

    def expand(
        self,
        h: Tensor,
        weights: Sequence[LoRASliceWeights],
        meta: LoRABatchMeta,
        y: Tensor,
        slice_offsets: Sequence[int],
    ) -> None:
        """``y[t, off_i : off_i + out_i] += scale * h[i, t, :r] @ B_{i,slot(t)}^T`` in place."""
        ...


class AttentionOps(Protocol):
    def paged_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: Tensor,
        meta: AttentionMeta,
        scale: float,
    ) -> Tensor:
        """Write k/v rows into ``kv_cache`` at ``meta.slot_mapping``, then causal attention.

        q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_blocks * block_size, Hkv, D].
        Returns [T, Hq, D]. GQA: query head j reads kv head j // (Hq // Hkv).
        """
        ...


class Backend(Protocol):
    """A device backend: its name in the registry, its device, and its ops."""

    name: str
    device: torch.device
    lora: LoRAOps
    attention: AttentionOps

    def synchronize(self) -> None: ...

    # Optional: ``dtype_problem(dtype: str) -> str | None``, why this very device cannot run the
    # dtype (the matrix states a backend's dtypes, not each chip's); the engine refuses the config
    # with that reason (CapabilityError) before it loads any weight.


def apply_lora(
    ops: LoRAOps,
    x: Tensor,
    y: Tensor,
    weights: Sequence[LoRASliceWeights],
    meta: LoRABatchMeta,
    slice_offsets: Sequence[int],
    workspace: Tensor,
) -> None:
    """``y += LoRA(x)`` for every slice: shrink into ``workspace`` then expand into ``y``.

    workspace: float32 [>= n_slices, >= T, >= max rank]; reused across layers.
    A backend whose ops also offer a fused ``apply(x, y, weights, meta, slice_offsets,
    workspace)`` (e.g. Ascend's npu_batch_gather_matmul, which needs x and y in one
    call) gets the whole update in one call instead. Ops that set ``interleaved_a = True``
    get each fused projection's A rows interleaved in one buffer (and its B rows too, as
    strided ``b_rows`` views, when the slices have one width)
    (``LoRASliceWeights.allocate_projection``), so one shrink can serve all its slices.
    """
    if not meta.has_lora or not any(any(w.host_rank) for w in weights):
        return  # no row has an adapter, or no resident adapter targets this projection (the MLP under q/k/v/o adapters)
    fused = getattr(ops, "apply", None)
    if fused is not None:
        fused(x, y, weights, meta, slice_offsets, workspace)
        return
    t = x.shape[0]
    h = workspace[: len(weights), :t]
    ops.shrink(x, weights, meta, h)
    ops.expand(h, weights, meta, y, slice_offsets)
