"""The CUDA backend: Triton LoRA kernels, attention through the reference gather + SDPA (kept off
cuDNN's SDPA, which builds a plan per shape: ``backends/cuda/attention.py``).

``CudaLoRAOps`` picks the schedule per step: per-token (BGMV) kernels when
``meta.decode_only`` (every row is one decode token), segment (SGMV) kernels
otherwise. Both launch ONE kernel per op for all slices of a layer (q/k/v, gate/up),
through a per-slice pointer table cached per slice group (see ``slice_table``), so a
steady-state forward does no host->device copies and reads no device data on the host.

CUDA graphs (the engine does not capture any; ``runtime/verifiers/cuda_graph.py`` checks
capture and replay): capture after one warm-up forward in the state to be captured (it
builds the tables and compiles the kernels). The per-token grids depend on the batch size,
the slices' widths and (through the tile sizes) the ranks resident at capture, and the kernels walk
each slot's own rank at run time, so a replay with other adapters in the rows stays correct,
with one condition: the host decides whether to launch at all (``runtime.backend_api.apply_lora``
skips a slice group when no row has an adapter or no resident adapter targets it, and
reaches no launcher, so no table is built for it either), so a graph captured in such a state
holds no LoRA kernel there and a replay after adapters are loaded would skip LoRA; and a
group first reached during capture would build its table (a host->device copy) inside it.
Warm up and capture with an adapter resident in every slice group and at least one adapter row.
"""
from __future__ import annotations

import importlib.util
from typing import Sequence

import torch
from torch import Tensor

from backends.cuda.attention import CudaAttention
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights


class CudaLoRAOps:
    """Triton shrink/expand (``runtime.backend_api.LoRAOps``); works on any device Triton
    can launch on, including CPU tensors under ``TRITON_INTERPRET=1``."""

    def __init__(self, table_cache_capacity: int = 4096) -> None:
        # Imported here so that `backends.cuda.backend` (and its availability()) can be
        # imported on machines without triton.
        from backends.cuda.bgmv_expand import bgmv_expand
        from backends.cuda.bgmv_shrink import bgmv_shrink
        from backends.cuda.sgmv_expand import sgmv_expand
        from backends.cuda.sgmv_shrink import sgmv_shrink
        from backends.cuda.slice_table import SliceTableCache

        self._shrink = {True: bgmv_shrink, False: sgmv_shrink}
        self._expand = {True: bgmv_expand, False: sgmv_expand}
        self.tables = SliceTableCache(table_cache_capacity)

    def shrink(self, x: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, out: Tensor) -> None:
        """``out[i, t, :r] = x[t] @ A_{i,slot(t)}^T`` (BGMV if ``meta.decode_only`` else SGMV)."""
        table = self.tables.get(weights, [0] * len(weights))
        self._shrink[meta.decode_only](x, weights, meta, out, table)

    def expand(
        self, h: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, y: Tensor, slice_offsets: Sequence[int]
    ) -> None:
        """``y[t, o_i:o_i+n_i] += scale * h[i, t, :r] @ B_{i,slot(t)}^T`` in place."""
        table = self.tables.get(weights, slice_offsets)
        self._expand[meta.decode_only](h, weights, meta, y, slice_offsets, table)


class CudaBackend:
    """NVIDIA GPUs: Triton LoRA kernels; attention = gather + SDPA without cuDNN (``CudaAttention``)."""

    name = "cuda"

    def __init__(self, device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaBackend: device must be a cuda device, got {self.device}")
        ok, reason = self.availability()
        if not ok:
            raise RuntimeError(reason)
        # Triton launches on the current device, not on the tensors' one: a tensor on another
        # GPU would be read through a pointer that is not valid there.
        current = torch.cuda.current_device()
        if self.device.index is not None and self.device.index != current:
            raise ValueError(f"CudaBackend: {self.device} is not the current CUDA device (cuda:{current}); the kernels launch on the "
                             f"current one. Select the GPU with CUDA_VISIBLE_DEVICES or torch.cuda.set_device({self.device.index}) first")
        self.lora = CudaLoRAOps()
        self.attention = CudaAttention()

    def dtype_problem(self, dtype: str) -> str | None:
        """Why this GPU cannot run ``dtype`` (the engine refuses the config with it), or None:
        the kernels' bfloat16 ``tl.dot`` needs compute capability 8.0 (Ampere) or newer, and
        Triton's compiler rejects it below (ptxas: ".bf16 requires sm_80")."""
        if dtype != "bfloat16":
            return None
        major, minor = torch.cuda.get_device_capability(self.device)
        if (major, minor) < (8, 0):
            return (f"{torch.cuda.get_device_name(self.device)} is sm_{major}{minor}; the Triton LoRA kernels' bfloat16 matmuls need "
                    "sm_80 or newer: serve with --dtype float16 or float32")
        return None

    @staticmethod
    def availability() -> tuple[bool, str]:
        if importlib.util.find_spec("triton") is None:
            return False, "cuda: triton is not installed (pip install 'lorafleet[cuda]')"
        if not torch.cuda.is_available():
            return False, "cuda: torch.cuda.is_available() is False"
        return True, f"cuda: {torch.cuda.get_device_name(torch.cuda.current_device())}"

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
