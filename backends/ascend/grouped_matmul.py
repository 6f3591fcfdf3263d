"""Prefill (segment) LoRA on ``torch_npu.npu_grouped_matmul``, grouping along M.

One call per (slice, rank bucket, chunk of <= 128 segments); see ``segment_plan``.
With ``M`` rows gathered in segment order and ``g`` groups of rank ``R``:

    shrink:  x_b [M, in]  @ W_a [g, K=in, N=R]   -> h_b [M, R]
             W_a[j] = A_{slot_j}^T   (rows start_j .. start_j+R of a_rows, transposed)
    expand:  h_b [M, R]   @ W_b [g, K=R, N=out]  -> d_b [M, out]
             W_b[j] = B_{slot_j}^T   (rows start_j .. start_j+R of b_rows, already B^T)
             y[rows, off:off+out] += scale_{slot(row)} * d_b

Op arguments (from torch_npu's op docs): ``group_type=0`` (split along M),
``split_item=2`` (x, weight, y each one tensor: "single-single-single", weight 3-D),
``group_list`` int64 on the device as a cumsum (``group_list_type=0``; counts, type 1,
are refused by the docs for a single group, so cumsum is always used). The op has no
per-group scale outside quantisation, so the scale is applied in fp32 to its output.

Cost: the call's weights are gathered into ``[g, K, N]`` (one ``index_select`` per call,
``g*R*(in or out)`` elements); the op's output has x's dtype, so ``h`` is rounded to the
compute dtype between shrink and expand (fp32 accumulate inside the op is assumed).
"""
from __future__ import annotations

import torch
from torch import Tensor

from backends.ascend.segment_plan import GroupCall
from backends.ascend.soc import SocFamily
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights

INNER_LIMIT = 65536  # docs: last dim of every x_i / weight_i must be < 65536 (Atlas A2)
A2_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SPLIT_ITEM_SINGLE = 2
GROUP_TYPE_M = 0
GROUP_LIST_CUMSUM = 0


def unsupported_reason(soc: SocFamily, dtype: torch.dtype, k: int, n: int) -> tuple[str, str] | None:
    """(reason key, detail) if a ``[M,k] @ [g,k,n]`` call is outside the documented limits."""
    if soc is SocFamily.OTHER:
        return "prefill:soc", "npu_grouped_matmul is documented for Atlas A2 and Atlas 310P only; torch path"
    if soc is SocFamily.ATLAS_A2 and dtype not in A2_DTYPES:
        return "prefill:dtype", f"npu_grouped_matmul on Atlas A2 takes fp16/bf16/fp32, not {dtype}; torch path"
    if soc is SocFamily.ATLAS_INFERENCE_310P:
        if dtype != torch.float16:
            return "prefill:dtype", f"npu_grouped_matmul on Atlas 310P takes fp16 only, not {dtype}; torch path"
        if n % 16:
            return "prefill:n-multiple-16", f"npu_grouped_matmul on Atlas 310P needs N % 16 == 0, got N={n}; torch path"
    if k >= INNER_LIMIT or n >= INNER_LIMIT:
        return "prefill:inner-limit", f"npu_grouped_matmul needs K, N < {INNER_LIMIT}, got K={k}, N={n}; torch path"
    return None


def call_rows(meta: LoRABatchMeta, call: GroupCall) -> Tensor:
    """Row ids (int64, device) of the call's segments, in group order; views + one cat."""
    return torch.cat([meta.sorted_tokens[seg.begin : seg.end] for seg in call.segments]).long()


def _weight_stack(buffer: Tensor, weights: LoRASliceWeights, call: GroupCall) -> Tensor:
    """``[g, R, cols]``: rows start_j .. start_j+R of ``buffer`` for each group j."""
    rows = [weights.host_start[slot] + k for slot in call.slots for k in range(call.rank)]
    index = torch.tensor(rows, dtype=torch.int64, device=buffer.device)
    return buffer.index_select(0, index).view(len(call.segments), call.rank, buffer.shape[1])


def _group_list(call: GroupCall, device: torch.device) -> Tensor:
    return torch.tensor(call.cumsum(), dtype=torch.int64, device=device)


def _run(npu_ops, x: Tensor, weight: Tensor, call: GroupCall) -> Tensor:
    (out,) = npu_ops.npu_grouped_matmul(
        [x],
        [weight],
        group_list=_group_list(call, x.device),
        split_item=SPLIT_ITEM_SINGLE,
        group_type=GROUP_TYPE_M,
        group_list_type=GROUP_LIST_CUMSUM,
    )
    return out


def shrink_call(npu_ops, x: Tensor, weights: LoRASliceWeights, call: GroupCall, rows: Tensor, out_i: Tensor) -> None:
    """``out_i[rows, :R] = x[rows] @ A_slot^T`` for the call's groups."""
    xs = x.index_select(0, rows)
    w_a = _weight_stack(weights.a_rows, weights, call).transpose(1, 2).contiguous()  # [g, in, R]
    h = _run(npu_ops, xs, w_a, call)
    out_i[rows, : call.rank] = h.to(out_i.dtype)


def expand_call(
    npu_ops, h_i: Tensor, weights: LoRASliceWeights, call: GroupCall, rows: Tensor, y: Tensor, offset: int
) -> None:
    """``y[rows, off:off+out] += scale_slot * h_i[rows, :R] @ B_slot^T`` for the call's groups."""
    dtype = weights.b_rows.dtype
    hs = h_i.index_select(0, rows)[:, : call.rank].to(dtype).contiguous()
    w_b = _weight_stack(weights.b_rows, weights, call)  # [g, R, out]: b_rows holds B^T
    delta = _run(npu_ops, hs, w_b, call).float()
    device = y.device
    scales = torch.tensor([weights.host_scale[s] for s in call.slots], dtype=torch.float32, device=device)
    lengths = torch.tensor([seg.length for seg in call.segments], dtype=torch.int64, device=device)
    row_scale = scales.repeat_interleave(lengths, output_size=call.num_rows)  # output_size: no device sync
    cols = slice(offset, offset + weights.out_features)
    y[rows, cols] = (y[rows, cols].float() + delta * row_scale[:, None]).to(y.dtype)
