"""Decode (per token) LoRA on ``torch_npu.npu_batch_gather_matmul_`` (fused BGMV, "AddLora").

The op (torch_npu op docs), for every row b with ``indices[b] = w >= 0``:

    input[b, y_offset : y_offset + y_slice_size] += scale * (x[b] @ weight_a[w, layer_idx]^T) @ weight_b[w, layer_idx]^T

with input/x/weights fp16, ``weight_a [W, L, R, H1]``, ``weight_b [W, L, H2, R]``, R a
multiple of 16 in [16, 128], H1 and H2 multiples of 16, ``H2 < y_column``, indices int32
(-1 skips the row), Atlas A2 only. The in-place variant is called, so ``y`` is updated
where it lies. The CANN kernel under it (AddLora: ``aclnnAddLora.md`` and its tiling checks
in hicann/ops-math) adds limits the torch_npu page leaves out: W and L at most 32,
y_column a multiple of 16, H1, H2 and y_column at most 131072; and it adds into ``y``'s
buffer assuming rows ``y_column`` apart, so ``y`` must be contiguous. Buckets of more than
32 slots are split into several calls; the other limits send the bucket to the torch path.

Mapping, per (slice i, rank bucket R): the W slots of rank R used in this step become the
op's W; ``L = 1`` and ``layer_idx = 0`` (layers are separate calls in lorafleet);

    weight_a[w, 0] = A_{slot_w}                         [R, in]
    weight_b[w, 0] = scale_{slot_w} * B_{slot_w}        [out, R]   (scale folded in, fp32 then fp16)
    indices[b]     = w if slot(b) is slot_w, else -1    (other buckets, no adapter)

so ``scale=1.0`` is passed. Cost (not cached): every call gathers ``W*R*(in+out)`` fp16
elements into the op's layout, because the pool stores adapters as flat unpadded row
buffers, not as ``[W, L, R, H]``. For decode batches this copy is of the same order as
the op's own weight reads.
"""
from __future__ import annotations

import torch
from torch import Tensor

from backends.ascend.soc import SocFamily
from runtime.lora.slice_weights import LoRASliceWeights

MIN_RANK, MAX_RANK, RANK_STEP = 16, 128, 16
HIDDEN_MULTIPLE = 16
MAX_WEIGHTS_PER_CALL = 32  # AddLora's W limit (MAX_WEIGHT_NUM in its tiling)
MAX_HIDDEN = 131072  # AddLora's limit on H1, H2 and y_column


def unsupported_reason(
    soc: SocFamily, dtypes: tuple[torch.dtype, ...], rank: int, in_features: int, out_features: int, y_columns: int,
    y_contiguous: bool = True,
) -> tuple[str, str] | None:
    """(reason key, detail) if the fused op's documented limits do not hold, else None."""
    if soc is not SocFamily.ATLAS_A2:
        return "decode:soc", "npu_batch_gather_matmul is documented for Atlas A2 only; torch path"
    if any(d != torch.float16 for d in dtypes):
        return "decode:dtype", f"npu_batch_gather_matmul takes fp16 only, got {sorted({str(d) for d in dtypes})}; torch path"
    if rank % RANK_STEP or not MIN_RANK <= rank <= MAX_RANK:
        return "decode:rank", f"npu_batch_gather_matmul needs rank a multiple of 16 in 16..128, got {rank}; torch path"
    if in_features % HIDDEN_MULTIPLE or out_features % HIDDEN_MULTIPLE:
        return "decode:hidden-multiple-16", (
            f"npu_batch_gather_matmul needs in/out multiples of 16, got in={in_features}, out={out_features}; torch path"
        )
    if y_columns % HIDDEN_MULTIPLE:
        return "decode:y-width-multiple-16", f"AddLora (under npu_batch_gather_matmul) needs y's width a multiple of 16, got {y_columns}; torch path"
    if max(in_features, out_features, y_columns) > MAX_HIDDEN:
        return "decode:hidden-limit", (
            f"AddLora (under npu_batch_gather_matmul) takes in, out and y widths up to {MAX_HIDDEN}, got in={in_features}, "
            f"out={out_features}, y={y_columns}; torch path"
        )
    if not y_contiguous:
        return "decode:y-not-contiguous", "AddLora adds into y's buffer assuming contiguous rows; y is a strided view; torch path"
    if out_features >= y_columns:
        # The docs say H2 < y_column (strict). Read literally until hardware shows <= is fine.
        return "decode:slice-width", (
            f"npu_batch_gather_matmul documents H2 < y_column; slice width {out_features} >= y width {y_columns}; torch path"
        )
    return None


def bucket_weights(weights: LoRASliceWeights, slots: list[int], rank: int) -> tuple[Tensor, Tensor]:
    """``(weight_a [W,1,R,in], weight_b [W,1,out,R])`` fp16, scale folded into weight_b."""
    device = weights.a_rows.device
    rows = torch.tensor([weights.host_start[s] + k for s in slots for k in range(rank)], dtype=torch.int64, device=device)
    w = len(slots)
    a = weights.a_rows.index_select(0, rows).view(w, rank, weights.in_features)
    b_t = weights.b_rows.index_select(0, rows).view(w, rank, weights.out_features)
    scale = weights.slot_scale.index_select(0, torch.tensor(slots, dtype=torch.int64, device=device))
    b = (b_t.float() * scale[:, None, None]).to(torch.float16).transpose(1, 2)
    return a.to(torch.float16).unsqueeze(1).contiguous(), b.unsqueeze(1).contiguous()


def bucket_indices(token_slots: Tensor, slots: list[int], max_slots: int) -> Tensor:
    """int32 ``[T]``: the bucket-local index of each row's slot, -1 for other rows."""
    table = [-1] * max_slots
    for local, slot in enumerate(slots):
        table[slot] = local
    lookup = torch.tensor(table, dtype=torch.int32, device=token_slots.device)
    picked = lookup.index_select(0, token_slots.clamp(min=0).long())
    return torch.where(token_slots >= 0, picked, torch.full_like(picked, -1))


def apply_bucket(
    npu_ops, x: Tensor, y: Tensor, weights: LoRASliceWeights, slots: list[int], rank: int, token_slots: Tensor, offset: int
) -> None:
    """``y[t, off:off+out] += scale * x[t] @ A^T @ B^T`` for the rows whose slot is in ``slots``:
    one op call per ``MAX_WEIGHTS_PER_CALL`` slots (rows of the other slots are -1 in each)."""
    for start in range(0, len(slots), MAX_WEIGHTS_PER_CALL):
        chunk = slots[start : start + MAX_WEIGHTS_PER_CALL]
        weight_a, weight_b = bucket_weights(weights, chunk, rank)
        indices = bucket_indices(token_slots, chunk, weights.max_slots)
        npu_ops.npu_batch_gather_matmul_(
            y,
            x,
            weight_b,
            indices,
            weight_a,
            layer_idx=0,
            scale=1.0,
            y_offset=offset,
            y_slice_size=weights.out_features,
        )
