"""CPU emulation of two torch_npu operators, written from torch_npu's op docs
(``torch_npu/_op_plugin_docs.py`` in the 2.14.0 wheel). Tests only: injected into
``AscendBackend(npu_ops=...)``, never shipped as a fallback.

It enforces the documented limits as errors, so a backend that builds arguments the
real op would refuse fails here too. It counts calls so tests can tell which path ran.
Where the docs are silent (noted inline), the emulation takes the strict choice.

npu_grouped_matmul, non-quantised, Atlas A2 ("Atlas A2 训练系列产品/Atlas 800I A2"):
    group_type=0, x=[x] 2-D [M, K], weight=[w] 3-D [g, K, N], split_item 2/3 -> [y] [M, N]
    rows of group j (from group_list) : y[rows_j] = x[rows_j] @ w[j]
    x/weight list length <= 128; group_list int64 1-D, length g <= 1024;
    type 0: non-negative, non-decreasing cumsum, last == M; type 1: non-negative counts,
    length != 1, sum == M; x.dtype == weight.dtype in {fp16, bf16, fp32};
    last dims (K of x, N of weight) < 65536; output_dtype None (or x's dtype); x not transposed
    ("x不支持转置", both product lines: taken here as a unit column stride).
    Atlas inference (310P) adds: fp16 only, and N % 16 == 0 (``chip="atlas_inference_310p"``).

npu_batch_gather_matmul(_), Atlas A2 only ("支持的型号: Atlas A2"; refused for
    ``chip="atlas_inference_310p"``): fp16, input [B, y_col], x [B, H1] (H1 % 16 == 0),
    weight_a [W, L, R, H1], weight_b [W, L, H2, R] (H2 % 16 == 0, H2 < y_col),
    R % 16 == 0 in [16, 128], indices int32 [B] (-1 skips the row), layer_idx < L,
    y_offset < y_col; with weight_a None the first matmul is skipped and weight_b is
    [W, L, H2, H1]; y_slice_size -1 means y_col.
    input[b, off:off+H2] += scale * (x[b] @ weight_a[w, l]^T) @ weight_b[w, l]^T
    The CANN kernel behind it (AddLora, hicann/ops-math ``math/add_lora``: aclnnAddLora.md,
    add_lora_tiling.cpp, add_lora_base.h) adds: W and L in 1..32; y_col a multiple of 16;
    H1, H2, y_col <= 131072; y_slice_size <= H2 (H2 columns are written at y_offset); input
    contiguous: the kernel atomically adds into the *input* y's buffer at ``row * y_col`` (never into
    ``out``, add_lora_base.h CopyOutRes), so a strided input copied to a contiguous temporary by the
    aclnn layer would take the update and ``input`` would keep its old values; and its
    arithmetic: x @ A^T accumulated in fp32 and stored as fp16, (.) @ B^T likewise, scale
    applied in fp16, then an fp16 add into y. The emulation rounds at the same places.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor

MAX_LIST = 128
ADD_LORA_MAX_W = ADD_LORA_MAX_L = 32
ADD_LORA_MAX_HIDDEN = 131072
MAX_GROUPS_SSS = 1024
INNER_LIMIT = 65536
A2_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class NpuOpError(RuntimeError):
    """The real op would reject these arguments (a documented limit is violated)."""


class EmulatedTorchNpuOps:
    """``npu_grouped_matmul`` and ``npu_batch_gather_matmul(_)`` on CPU tensors, with call counts."""

    def __init__(self, chip: str = "atlas_a2") -> None:
        """``chip``: the product line whose documented limits are enforced ("atlas_a2" or "atlas_inference_310p")."""
        if chip not in ("atlas_a2", "atlas_inference_310p"):
            raise ValueError(f"chip: the emulation knows atlas_a2 and atlas_inference_310p, got {chip!r}")
        self.chip = chip
        self.calls: Counter[str] = Counter()
        self.groups_per_call: list[int] = []

    # ---------------------------------------------------------------- grouped matmul
    def npu_grouped_matmul(
        self,
        x: list[Tensor],
        weight: list[Tensor],
        *,
        bias=None,
        scale=None,
        offset=None,
        antiquant_scale=None,
        antiquant_offset=None,
        per_token_scale=None,
        group_list=None,
        activation_input=None,
        activation_quant_scale=None,
        activation_quant_offset=None,
        split_item: int = 0,
        group_type: int | None = None,
        group_list_type: int = 0,
        act_type: int = 0,
        output_dtype: torch.dtype | None = None,
        tuning_config=None,
    ) -> list[Tensor]:
        quant = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
                 activation_quant_scale, activation_quant_offset)
        if any(v is not None for v in quant) or act_type != 0:
            raise NotImplementedError("emulation covers the non-quantised, no-bias, no-activation case only")
        if group_type != 0:
            raise NotImplementedError(f"emulation covers group_type=0 only, got {group_type}")
        if not isinstance(x, (list, tuple)) or not isinstance(weight, (list, tuple)):
            raise NpuOpError("x and weight are lists of tensors")
        if not 1 <= len(x) <= MAX_LIST or not 1 <= len(weight) <= MAX_LIST:
            raise NpuOpError(f"x/weight lists hold 1..{MAX_LIST} tensors, got {len(x)}/{len(weight)}")
        if len(x) != 1 or len(weight) != 1:
            raise NotImplementedError("emulation covers single-single-single (one x, one 3-D weight) only")
        if split_item not in (2, 3):
            raise NpuOpError(f"group_type=0 needs split_item 2 or 3, got {split_item}")
        xs, w = x[0], weight[0]
        if xs.dim() != 2 or w.dim() != 3:
            raise NpuOpError(f"single-single-single needs x 2-D and weight 3-D, got {xs.dim()}-D/{w.dim()}-D")
        if xs.shape[1] > 1 and xs.stride(1) != 1:
            raise NpuOpError(f"x must not be transposed (group_type=0), got strides {xs.stride()}")
        if xs.dtype not in A2_FLOAT_DTYPES or w.dtype != xs.dtype:
            raise NpuOpError(f"x/weight dtypes must match and be fp16/bf16/fp32 (Atlas A2), got {xs.dtype}/{w.dtype}")
        if output_dtype not in (None, xs.dtype):
            raise NpuOpError(f"output_dtype must be None or x's dtype {xs.dtype}, got {output_dtype}")
        m, k = xs.shape
        g, kw, n = w.shape
        if kw != k:
            raise NpuOpError(f"weight K {kw} != x K {k}")
        if k >= INNER_LIMIT or n >= INNER_LIMIT:
            raise NpuOpError(f"inner dims must be < {INNER_LIMIT}: K={k}, N={n}")
        if m == 0 or g == 0:
            raise NpuOpError("empty tensors are not supported")
        if self.chip == "atlas_inference_310p" and (xs.dtype != torch.float16 or n % 16):
            raise NpuOpError(f"Atlas 310P: fp16 only and N % 16 == 0, got {xs.dtype}, N={n}")
        sizes = self._group_sizes(group_list, group_list_type, g, m)
        self.calls["npu_grouped_matmul"] += 1
        self.groups_per_call.append(g)
        out = torch.empty(m, n, dtype=xs.dtype, device=xs.device)
        begin = 0
        for j, size in enumerate(sizes):
            out[begin : begin + size] = (xs[begin : begin + size].float() @ w[j].float()).to(xs.dtype)
            begin += size
        return [out]

    @staticmethod
    def _group_sizes(group_list, group_list_type: int, g: int, m: int) -> list[int]:
        if not isinstance(group_list, Tensor):
            raise NpuOpError("group_type=0 needs group_list as a torch.Tensor")
        if group_list.dtype != torch.int64 or group_list.dim() != 1:
            raise NpuOpError(f"group_list must be 1-D int64, got {group_list.dim()}-D {group_list.dtype}")
        if group_list.shape[0] != g:
            raise NpuOpError(f"group_list has {group_list.shape[0]} entries for {g} weight groups")
        if g > MAX_GROUPS_SSS:
            raise NpuOpError(f"at most {MAX_GROUPS_SSS} groups, got {g}")
        values = [int(v) for v in group_list.tolist()]
        if any(v < 0 for v in values):
            raise NpuOpError(f"group_list must be non-negative: {values}")
        if group_list_type == 0:
            if any(b < a for a, b in zip(values, values[1:])):
                raise NpuOpError(f"group_list (cumsum) must be non-decreasing: {values}")
            if values[-1] != m:
                raise NpuOpError(f"last cumsum {values[-1]} != M={m}")
            return [b - a for a, b in zip([0] + values[:-1], values)]
        if group_list_type == 1:
            if len(values) == 1:
                raise NpuOpError("group_list_type=1 (counts) must not have length 1")
            if sum(values) != m:
                raise NpuOpError(f"group sizes sum to {sum(values)}, M={m}")
            return values
        raise NpuOpError(f"group_list_type must be 0 or 1, got {group_list_type}")

    # ---------------------------------------------------------------- batch gather matmul
    def npu_batch_gather_matmul(self, input, x, weight_b, indices, weight_a=None, layer_idx=0, scale=1e-3,
                                y_offset=0, y_slice_size=-1) -> Tensor:
        """Docs: the output reuses ``input``'s memory, so this is the in-place op."""
        return self.npu_batch_gather_matmul_(input, x, weight_b, indices, weight_a, layer_idx, scale, y_offset, y_slice_size)

    def npu_batch_gather_matmul_(self, input, x, weight_b, indices, weight_a=None, layer_idx=0, scale=1e-3,
                                 y_offset=0, y_slice_size=-1) -> Tensor:
        if self.chip != "atlas_a2":
            raise NpuOpError(f"npu_batch_gather_matmul runs on Atlas A2 only, not {self.chip}")
        tensors = {"input": input, "x": x, "weight_b": weight_b} | ({} if weight_a is None else {"weight_a": weight_a})
        for name, t in tensors.items():
            if t.dtype != torch.float16:
                raise NpuOpError(f"{name} must be float16, got {t.dtype}")
            if t.numel() == 0:
                raise NpuOpError(f"{name} must not be empty")
        if input.dim() != 2 or x.dim() != 2 or weight_b.dim() != 4:
            raise NpuOpError("input and x are 2-D, weight_b is 4-D")
        if not input.is_contiguous():
            # Not a documented error (the page says strided tensors are accepted), but the AddLora
            # kernel adds into input's own buffer with rows y_column apart: a strided input would
            # not be updated where it lies. Refused, so a backend that sends one fails here.
            raise NpuOpError(f"input must be contiguous (AddLora adds into its buffer, rows y_column apart), got strides {input.stride()}")
        batch, y_col = input.shape
        h1 = x.shape[1]
        if x.shape[0] != batch:
            raise NpuOpError(f"x has {x.shape[0]} rows, input {batch}")
        if h1 % 16:
            raise NpuOpError(f"H1={h1} must be a multiple of 16")
        w, l, h2, r = weight_b.shape
        if weight_a is not None:
            if weight_a.dim() != 4 or tuple(weight_a.shape) != (w, l, r, h1):
                raise NpuOpError(f"weight_a must be [W={w}, L={l}, R={r}, H1={h1}], got {tuple(weight_a.shape)}")
            if r % 16 or not 16 <= r <= 128:
                raise NpuOpError(f"R={r} must be a multiple of 16 in [16, 128]")
        elif r != h1:
            raise NpuOpError(f"without weight_a, weight_b is [W, L, H2, H1]; last dim {r} != H1={h1}")
        if h2 % 16:
            raise NpuOpError(f"H2={h2} must be a multiple of 16")
        if not h2 < y_col:
            raise NpuOpError(f"H2={h2} must be < y_column={y_col}")
        if y_col % 16:
            raise NpuOpError(f"y_column={y_col} must be a multiple of 16 (AddLora tiling)")
        if max(h1, h2, y_col) > ADD_LORA_MAX_HIDDEN:
            raise NpuOpError(f"H1={h1}, H2={h2}, y_column={y_col} must be <= {ADD_LORA_MAX_HIDDEN} (AddLora tiling)")
        if not 1 <= w <= ADD_LORA_MAX_W or not 1 <= l <= ADD_LORA_MAX_L:
            raise NpuOpError(f"W={w} and L={l} must be in 1..32 (AddLora tiling: weight num exceeds limit 32)")
        if indices.dtype != torch.int32 or tuple(indices.shape) != (batch,):
            raise NpuOpError(f"indices must be int32 [{batch}], got {indices.dtype} {tuple(indices.shape)}")
        if not 0 <= layer_idx < l:
            raise NpuOpError(f"layer_idx={layer_idx} must be in [0, L={l})")
        if not 0 <= y_offset < y_col:
            raise NpuOpError(f"y_offset={y_offset} must be in [0, y_column={y_col})")
        size = y_col if y_slice_size == -1 else y_slice_size
        # AddLora's tiling requires y_slice_size <= H2; the kernel writes H2 columns from y_offset.
        if not 1 <= size <= h2 or y_offset + h2 > y_col:
            raise NpuOpError(f"y_slice_size={size} must be in 1..H2={h2}, and H2 columns at y_offset={y_offset} must fit y_column={y_col}")
        idx = [int(v) for v in indices.tolist()]
        if any(not -1 <= v < w for v in idx):
            raise NpuOpError(f"indices must be in [-1, W={w}): {idx}")
        self.calls["npu_batch_gather_matmul"] += 1
        rows = [b for b, v in enumerate(idx) if v >= 0]
        if not rows:
            return input
        rows_t = torch.tensor(rows, dtype=torch.int64)
        sel = torch.tensor([idx[b] for b in rows], dtype=torch.int64)
        xr = x[rows_t].float()  # [n, H1]
        # As the AddLora kernel: each matmul accumulates in fp32 and is stored as fp16, the
        # scale is applied in fp16, and the result is added into y in fp16.
        h = xr if weight_a is None else torch.einsum("nh,nrh->nr", xr, weight_a[sel, layer_idx].float()).half().float()
        z = torch.einsum("nr,nor->no", h, weight_b[sel, layer_idx].float()).half()
        delta = z * torch.tensor(scale, dtype=torch.float16)
        cols = slice(y_offset, y_offset + h2)
        input[rows_t, cols] = input[rows_t, cols] + delta
        return input
