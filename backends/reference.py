"""Pure-torch ops: the CPU backend, and the definition every kernel is tested against.

LoRA (see ``runtime.backend_api``), for every row t with slot s = slot(t) != -1:

    shrink:  h[i, t, :r_{i,s}]      = x[t] @ A_{i,s}^T                     (fp32 accumulate)
    expand:  y[t, o_i : o_i + n_i] += scale_{i,s} * h[i, t, :r_{i,s}] @ B_{i,s}^T

where ``A_{i,s} = a_rows[start : start + r]`` and ``B_{i,s}^T = b_rows[start : start + r]``
of slice i's flat buffers. Two equivalent schedules are provided:

- segment (SGMV, prefill): one matmul per (slice, segment of rows sharing a slot);
  when the segments are row ranges (``meta.first_row``), in place on them;
- per-token (BGMV, decode): gather each row's rank-padded weights and ``bmm``.

Both accumulate in float32 and cast the result to ``y``'s dtype once.

Attention: write the new K/V into the paged cache, gather the blocks, and run causal
``scaled_dot_product_attention``; decode rows batched in groups of similar context length,
with each kv head's query heads as query rows (no K/V repeat), prefill chunks one sequence
at a time (GQA by repeating kv heads). On the CPU backend a bf16/fp16 model's decode groups
compute in float32 (``ReferenceAttention.decode_in_float32``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.kv.attention_meta import AttentionMeta
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.op_arguments import check_expand, check_shrink
from runtime.lora.slice_weights import LoRASliceWeights, interleaved_a, interleaved_b, shared_block

# Decode attention on the CPU gathers K for at most this many bytes per SDPA call (V the
# same again): about one core's share of a server L2/L3, so the gathered blocks are still in
# cache when SDPA reads them. On the 2-core dev machine, 32 decodes with contexts of 10-612
# tokens (8 heads of 64): 5.4 ms per layer against 37-38 ms as one padded group
# (docs/benchmarks.md, "Decode attention on the CPU").
CPU_ATTENTION_GROUP_BYTES = 2 << 20


def _segment_rows(meta: LoRABatchMeta) -> list[tuple[int, Tensor]]:
    """(slot, row ids) for each segment, from host offsets (no device reads)."""
    starts = meta.host_seg_starts
    return [(slot, meta.sorted_tokens[starts[i] : starts[i + 1]].long()) for i, slot in enumerate(meta.host_seg_slots)]


def shrink_segment(x: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, out: Tensor) -> None:
    """SGMV shrink: ``out[i, rows_s, :r] = x[rows_s] @ A_{i,s}^T`` per segment s."""
    for slot, rows in _segment_rows(meta):
        xs = x.index_select(0, rows).float()
        for i, w in enumerate(weights):
            r, start = w.host_rank[slot], w.host_start[slot]
            if r == 0:
                continue
            a = w.a_rows[start : start + r].float()
            out[i, :, :r].index_copy_(0, rows, (xs @ a.t()).to(out.dtype))


def expand_segment(
    h: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, y: Tensor, slice_offsets: Sequence[int]
) -> None:
    """SGMV expand: ``y[rows_s, o_i:o_i+n_i] += scale * h[i, rows_s, :r] @ B_{i,s}^T``."""
    for slot, rows in _segment_rows(meta):
        for i, w in enumerate(weights):
            r, start = w.host_rank[slot], w.host_start[slot]
            if r == 0:
                continue
            b_t = w.b_rows[start : start + r].float()
            delta = h[i, rows, :r].float() @ b_t
            cols = slice(slice_offsets[i], slice_offsets[i] + w.out_features)
            if y.dtype == torch.float32:  # add in place: one kernel instead of gather + add + scatter
                y[:, cols].index_add_(0, rows, delta, alpha=w.host_scale[slot])
            else:  # accumulate in fp32, round to y's dtype once
                y[rows, cols] = (y[rows, cols].float() + w.host_scale[slot] * delta).to(y.dtype)


def _gather_per_token(w: LoRASliceWeights, slots: Tensor, rank_pad: int, buffer: Tensor) -> Tensor:
    """Per-row rank-padded weights: ``[T, rank_pad, cols]``, zero past each row's rank."""
    safe = slots.clamp(min=0).long()
    start = w.slot_start.long()[safe]
    rank = w.slot_rank.long()[safe] * (slots >= 0).long()
    offs = torch.arange(rank_pad, device=slots.device)
    idx = start[:, None] + offs[None, :]
    valid = offs[None, :] < rank[:, None]
    idx = torch.where(valid, idx, torch.zeros_like(idx))
    gathered = buffer.float()[idx]  # [T, rank_pad, cols]
    return gathered * valid[..., None]


def shrink_per_token(x: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, out: Tensor) -> None:
    """BGMV shrink: ``out[i, t, :r] = x[t] @ A_{i,slot(t)}^T`` for rows with an adapter."""
    slots = meta.token_slots
    for i, w in enumerate(weights):
        pad = w.max_rank
        if pad == 0:
            continue
        a = _gather_per_token(w, slots, pad, w.a_rows)  # [T, pad, in]
        h = torch.bmm(a, x.float()[:, :, None])[:, :, 0]  # [T, pad]
        rank = w.slot_rank.long()[slots.clamp(min=0).long()] * (slots >= 0).long()
        keep = torch.arange(pad, device=x.device)[None, :] < rank[:, None]
        out[i, :, :pad] = torch.where(keep, h.to(out.dtype), out[i, :, :pad])


def expand_per_token(
    h: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, y: Tensor, slice_offsets: Sequence[int]
) -> None:
    """BGMV expand: ``y[t, o_i:o_i+n_i] += scale * h[i, t, :r] @ B_{i,slot(t)}^T``."""
    slots = meta.token_slots
    has = (slots >= 0)[:, None]
    for i, w in enumerate(weights):
        pad = w.max_rank
        if pad == 0:
            continue
        b_t = _gather_per_token(w, slots, pad, w.b_rows)  # [T, pad, out]
        scale = w.slot_scale[slots.clamp(min=0).long()] * has[:, 0]
        rank = w.slot_rank.long()[slots.clamp(min=0).long()] * has[:, 0].long()
        in_rank = torch.arange(pad, device=h.device)[None, :] < rank[:, None]
        # Entries past a row's rank are never read (they may hold anything, even NaN).
        hi = torch.where(in_rank, h[i, :, :pad].float(), 0.0)[:, None, :]  # [T, 1, pad]
        delta = torch.bmm(hi, b_t)[:, 0, :] * scale[:, None]
        cols = slice(slice_offsets[i], slice_offsets[i] + w.out_features)
        y[:, cols] = torch.where(has, (y[:, cols].float() + delta).to(y.dtype), y[:, cols])


def apply_segment_sorted(
    x: Tensor, y: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, slice_offsets: Sequence[int]
) -> None:
    """Fused shrink + expand in sorted-row order: ``y[t, slice_i] += scale * (x[t] @ A^T) @ B^T``.

    Rows are gathered once into adapter order (``xs = x[sorted_tokens]``), every segment
    works on contiguous row ranges of ``xs`` and of one delta buffer per slice, and the
    deltas are added back with one ``index_add_`` per slice. The low-rank intermediate
    never goes through the ``[n_slices, T, R]`` workspace, which saves a scatter and a
    gather per (segment, slice): on CPU these small ops, not the math, dominate.
    """
    order = meta.sorted_tokens.long()
    xs = x.index_select(0, order).float()
    starts = meta.host_seg_starts
    for i, w in enumerate(weights):
        segments = [(slot, starts[k], starts[k + 1]) for k, slot in enumerate(meta.host_seg_slots) if w.host_rank[slot] > 0]
        if not segments:
            continue
        covered = sum(hi - lo for _, lo, hi in segments) == xs.shape[0]
        delta = (torch.empty if covered else torch.zeros)(xs.shape[0], w.out_features, dtype=torch.float32, device=x.device)
        for slot, lo, hi in segments:
            r, start = w.host_rank[slot], w.host_start[slot]
            h = (xs[lo:hi] @ w.a_rows[start : start + r].float().t()).mul_(w.host_scale[slot])  # scale the rank-r side
            delta[lo:hi] = h @ w.b_rows[start : start + r].float()
        cols = y[:, slice_offsets[i] : slice_offsets[i] + w.out_features]
        if y.dtype == torch.float32:
            cols.index_add_(0, order, delta)
        else:  # accumulate in fp32, round to y's dtype once
            cols.index_copy_(0, order, (cols.index_select(0, order).float() + delta).to(y.dtype))


@dataclass(frozen=True)
class SlotViews:
    """One slot's operands for a segment, as views into the slice buffers.

    ``a_block`` is the interleaved ``[R * K, in]`` A block when one shrink serves every
    slice (``interleaved_a`` and ``shared_block``), else None and each slice has its own
    ``a``. ``slices`` holds ``(i, r, a_i or None, B_i^T [r, n_i], scale)`` per targeted slice.
    ``b_block`` is ``[K, R, n]`` (a view of the interleaved B rows, ``interleaved_b``) when in
    addition every slice has rank R and one scale ``b_scale``: one batched matmul then does
    every expand of the segment; else None.
    """

    a_block: Tensor | None
    rank: int
    slices: tuple[tuple[int, int, Tensor | None, Tensor, float], ...]
    b_block: Tensor | None = None
    b_scale: float = 0.0

    @classmethod
    def build(cls, weights: Sequence[LoRASliceWeights], slot: int, as_float32: bool = False) -> "SlotViews":
        """The views of ``slot``; with ``as_float32``, float32 copies of them (for buffers of another dtype)."""
        group = interleaved_a(weights)
        block = shared_block(weights, slot) if group is not None else None
        a_block = None
        if block is not None:
            start, rank = block
            a_block = group[start : start + rank].reshape(rank * len(weights), -1)
        slices = []
        for i, w in enumerate(weights):
            r, start = w.host_rank[slot], w.host_start[slot]
            if r:
                a = None if a_block is not None else w.a_rows[start : start + r]
                slices.append((i, r, a, w.b_rows[start : start + r], w.host_scale[slot]))
        b_block, b_scale = None, 0.0
        b_group = interleaved_b(weights) if a_block is not None else None
        if b_group is not None and len(slices) == len(weights) and len({(r, scale) for _, r, _, _, scale in slices}) == 1:
            start, rank = block
            b_block, b_scale = b_group[start : start + rank].transpose(0, 1), slices[0][4]  # [K, R, n]
        if as_float32:
            a_block, b_block = (None if t is None else t.float() for t in (a_block, b_block))
            # With a B block every slice has its rank: its B is that block's slice i (no second copy).
            slices = [(i, r, None if a is None else a.float(), b.float() if b_block is None else b_block[i], scale)
                      for i, r, a, b, scale in slices]  # fmt: skip
        return cls(a_block, block[1] if block is not None else 0, tuple(slices), b_block, b_scale)

    @classmethod
    def cache_for(cls, weights: Sequence[LoRASliceWeights], as_float32: bool = False) -> dict[int, "SlotViews"]:
        """slot -> views for these slices (float32 copies: ``as_float32``, a cache of its own),
        kept in ``weights[0].view_cache`` and checked once per call, so the per-segment cost is
        one dict lookup. A change of the host slot tables drops the views of the slots whose
        entries changed; the others stay, since a view reads whatever its rows hold (with 500
        adapters cycling through 8 slots, dropping every slot's views at each load rebuilt them
        1472 times in a 48-request burst, against 216 now). A buffer swap (a new tensor, or new
        memory under the same one by ``set_``) drops them all.

        Copies (``as_float32``) must also see writes to their rows, including writes that change
        no slot table (a new version in the same rows, a write through a shallow copy of a slice).
        ``write_slot`` logs the rows it writes (``write_log``) and bumps each buffer's version
        counter once. So when every buffer's version moved by exactly the writes logged, only the
        copies of slots whose rows a logged write overlaps go; any other change of a version (an
        in-place write to the buffers, or more writes than the log keeps) drops every copy. Writes
        must go through the tensors: one through ``.data``, ``.numpy()`` or DLPack bumps no version
        counter and would leave the copies stale. Stale entries are dropped by the next call on
        these slices; a projection that no step reaches again keeps holding them."""
        # Identity and memory: ``Tensor.set_`` can swap a buffer's memory under the same object.
        buffers = tuple((id(t), t.data_ptr(), t.stride(), t.shape) for w in weights for t in (w.a_rows, w.b_rows, w.a_group, w.b_group) if t is not None)
        tables = tuple((w.version, tuple(w.host_start), tuple(w.host_rank), tuple(w.host_scale)) for w in weights)
        data = _data_stamp(weights) if as_float32 else None
        key = "row_ranges_float32" if as_float32 else "row_ranges"
        entry = weights[0].view_cache.get(key)
        fresh = entry is not None and len(entry[2]) == len(weights) and all(r() is w for r, w in zip(entry[2], weights))
        if fresh and entry[0] == buffers and entry[1] == tables and entry[5] == data:
            return entry[4]
        kept = {}
        if fresh and entry[0] == buffers and all(len(old[1]) == len(new[1]) for old, new in zip(entry[1], tables)):
            # A slot's views depend only on the buffers and its own table entries (copies: also on its
            # rows): the slots whose entries held, and (copies) whose rows no write touched, keep theirs.
            written = None if data is None else _rows_written(weights, entry[5], data)
            if data is None or written is not None:
                kept = {slot: views for slot, views in entry[4].items()
                        if all(_slot_entry(old, slot) == _slot_entry(new, slot) for old, new in zip(entry[1], tables))
                        and not (written and any(lo < w.host_start[slot] + w.host_rank[slot] and w.host_start[slot] < hi
                                                 for w in weights for lo, hi in written))}  # fmt: skip
        # Weak references to the slices (a strong one to weights[0] would be a cycle); the buffers
        # are kept alive with the entry, so their ids cannot be reused while it stands.
        entry = (buffers, tables, [weakref.ref(w) for w in weights], [(w.a_rows, w.b_rows, w.a_group, w.b_group) for w in weights], kept, data)
        weights[0].view_cache[key] = entry
        return kept


def _data_stamp(weights: Sequence[LoRASliceWeights]) -> tuple:
    """((storage, its version counter), ...) over the slices' A and B buffers, and each slice's
    ``write_log`` count."""
    versions = {t.untyped_storage().data_ptr(): t._version for w in weights for t in (w.a_rows, w.b_rows)}
    return tuple(sorted(versions.items())), tuple(w.write_log[0] for w in weights)


def _rows_written(weights: Sequence[LoRASliceWeights], old: tuple, new: tuple) -> list[tuple[int, int]] | None:
    """The row ranges ``write_slot`` wrote since ``old``, when those writes account for every version
    change of every buffer: each logged write bumped the two storages it names once, and those must
    be these buffers'. Else None (rows unknown): a write the logs did not see, more writes than a
    log keeps, or a logged write into other memory (a swapped-out buffer, a copy's own buffers)."""
    if [p for p, _ in old[0]] != [p for p, _ in new[0]]:
        return None
    before_versions = dict(old[0])
    moved = {p: v - before_versions[p] for p, v in new[0]}
    ranges, logs = [], set()
    for w, before, after in zip(weights, old[1], new[1]):
        if id(w.write_log) in logs:  # one log read by two of the slices (the same slice twice): its writes count once
            continue
        logs.add(id(w.write_log))
        entries = [e for e in w.write_log[1:] if e[0] > before]
        if len(entries) != after - before:
            return None  # more writes than the log keeps
        for _, lo, hi, *storages in entries:
            for p in storages:
                if p not in moved:
                    return None
                moved[p] -= 1
            ranges.append((lo, hi))
    return ranges if all(m == 0 for m in moved.values()) else None


def _slot_entry(table: tuple, slot: int) -> tuple:
    """One slot's (start, rank, scale) in a slice's stamped ``(version, starts, ranks, scales)``."""
    return table[1][slot], table[2][slot], table[3][slot]


def apply_row_ranges(
    x: Tensor, y: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, slice_offsets: Sequence[int]
) -> None:
    """Shrink + expand in place when every segment is a row range (``meta.first_row`` set).

    For segment k with slot s, rows ``lo .. hi`` of the step, and every slice i:

        y[lo:hi, o_i : o_i + n_i] += scale_{i,s} * (x[lo:hi] @ A_{i,s}^T) @ B_{i,s}^T

    No row gather, no delta buffer, no scatter: per segment one shrink matmul per slice,
    or one for all slices when their A rows are interleaved (``interleaved_a``), then
    one expand per slice, or (B rows interleaved too, every slice at the same rank and
    scale, columns side by side) one ``baddbmm_`` for all of them, each in place in float32.
    Other dtypes run the same float32 work on float32 copies: the adapter rows of ``x`` and
    ``y`` converted once per call, the slots' weights when a segment first needs them after any
    write to their rows (cached like the views; a write drops the copies of the slots whose rows
    it wrote, ``SlotViews.cache_for``; for a bf16 pool they take up to twice its bytes, for the slots in use;
    ``ModelRunner.memory_report`` counts them, ``lora_copies_bytes``), and the slices' columns of ``y``'s rows rounded back once. Decode steps have many one-row
    segments, where the cost is per op, not math: the operand views are cached per slot
    (``SlotViews.cache_for``) rather than sliced again for every segment.
    """
    first = meta.first_row
    if first is None:
        raise ValueError("apply_row_ranges: the rows with an adapter are not one run in slot order (meta.first_row is None)")
    copy_weights = not all(w.a_rows.dtype == w.b_rows.dtype == torch.float32 for w in weights)
    if x.dtype == y.dtype == torch.float32:
        _row_ranges_in_float32(x, y, weights, meta, slice_offsets, first, copy_weights)
        return
    rows = slice(first, first + meta.host_seg_starts[-1])
    y_rows = y[rows].float()
    _row_ranges_in_float32(x[rows].float(), y_rows, weights, meta, slice_offsets, 0, copy_weights)
    for off, w in zip(slice_offsets, weights):  # only the slices' columns: others keep their bits in any dtype
        y[rows, off : off + w.out_features] = y_rows[:, off : off + w.out_features]


def _row_ranges_in_float32(
    x: Tensor, y: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, slice_offsets: Sequence[int], first: int,
    copy_weights: bool,
) -> None:
    """``apply_row_ranges`` on float32 ``x`` and ``y``, segments starting at row ``first``, on the
    slots' views, or on float32 copies of them (``copy_weights``: buffers of another dtype)."""
    cache = SlotViews.cache_for(weights, as_float32=copy_weights)
    starts = meta.host_seg_starts
    columns = [y[:, off : off + w.out_features] for off, w in zip(slice_offsets, weights)]
    # The slices' columns side by side in order, all of one width: a segment's expands can be one batched matmul.
    width = weights[0].out_features
    side_by_side = all(off == slice_offsets[0] + i * width and w.out_features == width for i, (off, w) in enumerate(zip(slice_offsets, weights)))
    for k, slot in enumerate(meta.host_seg_slots):
        views = cache.get(slot)
        if views is None:
            views = cache[slot] = SlotViews.build(weights, slot, copy_weights)
        if not views.slices:  # this adapter does not target these modules
            continue
        lo, hi = first + starts[k], first + starts[k + 1]
        xs = x[lo:hi]
        if views.a_block is not None:
            # A @ x^T rather than x @ A^T: slice i's h is then h[:r, i].t(), a view that matmul
            # takes as a transposed operand; the other way round it is a strided copy.
            h_all = torch.mm(views.a_block, xs.t()).view(views.rank, len(weights), hi - lo)
            if views.b_block is not None and side_by_side:
                # y[lo:hi, slice i] += scale * h_i @ B_i^T for every i at once: [K, n, R] @ [K, R, n_out]
                out = y[lo:hi, slice_offsets[0] : slice_offsets[0] + len(weights) * width].view(hi - lo, len(weights), width)
                out.transpose(0, 1).baddbmm_(h_all.permute(1, 2, 0), views.b_block, alpha=views.b_scale)
                continue
        for i, r, a_i, b, scale in views.slices:
            h = h_all[:r, i].t() if a_i is None else torch.mm(xs, a_i.t())
            columns[i][lo:hi].addmm_(h, b, alpha=scale)


class ReferenceLoRAOps:
    """The CPU backend's ops: the segment schedule for every step, decode included.

    Measured on CPU (docs/benchmarks.md, "LoRA ops (CPU)"), the per-token schedule
    copies a rank-padded weight set per row and runs about 10x slower than one matmul
    per segment, so the CPU backend never uses it. The per-token functions above stay
    as the definition the BGMV kernels (cuda, npu) are tested against. The model path
    goes through ``apply``, which fuses shrink and expand (``apply_row_ranges`` for the
    engine's adapter-ordered steps).
    """

    # Fused projections get their A rows interleaved (``LoRASliceWeights.allocate_projection``):
    # one shrink matmul per segment then serves q/k/v (or gate/up) together.
    interleaved_a = True

    def apply(
        self, x: Tensor, y: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, slice_offsets: Sequence[int], workspace: Tensor
    ) -> None:
        """``y += LoRA(x)`` in one call (``apply_lora`` prefers this).

        When the rows come grouped by adapter (``meta.first_row`` set: every engine step,
        since the model runner orders sequences by slot), segments are row ranges and
        ``apply_row_ranges`` works on them in place. Otherwise decode steps (few rows,
        many segments) use the fused sorted-row path, measured ~15% faster on CPU than
        shrink + expand through ``workspace``, which prefill steps keep, since gathering
        and scattering whole prefill chunks measured ~2x slower.
        """
        h = workspace[: len(weights), : x.shape[0]]
        check_shrink(x, weights, meta, h)
        check_expand(h, weights, meta, y, slice_offsets)
        if meta.first_row is not None:
            apply_row_ranges(x, y, weights, meta, slice_offsets)
        elif meta.decode_only:
            apply_segment_sorted(x, y, weights, meta, slice_offsets)
        else:
            shrink_segment(x, weights, meta, h)
            expand_segment(h, weights, meta, y, slice_offsets)

    def shrink(self, x: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, out: Tensor) -> None:
        check_shrink(x, weights, meta, out)
        shrink_segment(x, weights, meta, out)

    @staticmethod
    def copied_bytes(slices: Sequence[LoRASliceWeights]) -> int:
        """Bytes of the float32 copies of slot weights now cached for ``slices`` (a bf16/fp16
        pool's, ``apply_row_ranges``); 0 for a float32 pool, whose ops read the pool's own rows.
        Each storage is counted once (a slice's B may be a view of its projection's B block)."""
        storages = {}
        for w in slices:
            entry = w.view_cache.get("row_ranges_float32")
            for views in entry[4].values() if entry is not None else ():
                tensors = [views.a_block, views.b_block] + [t for _, _, a, b, _ in views.slices for t in (a, b)]
                for t in tensors:
                    if t is not None:
                        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def expand(
        self, h: Tensor, weights: Sequence[LoRASliceWeights], meta: LoRABatchMeta, y: Tensor, slice_offsets: Sequence[int]
    ) -> None:
        check_expand(h, weights, meta, y, slice_offsets)
        expand_segment(h, weights, meta, y, slice_offsets)


@dataclass(frozen=True)
class _DecodeGroup:
    """One SDPA call's worth of decode rows: their step rows, whole blocks to gather, and mask."""

    width: int  # longest context in the group
    block_size: int
    n_blocks: int  # blocks per sequence gathered (ceil(width / block_size))
    blocks: Tensor  # [G * n_blocks] block ids, each sequence's table padded with block 0
    mask: Optional[Tensor]  # [G, 1, 1, width] True where a key is in context; None if all equal
    rows: Tensor  # [G] the sequences' rows in the step (q and out)


@dataclass(frozen=True)
class _PrefillChunk:
    """One sequence's several new rows ``lo:hi``: its blocks and the causal mask offset by the
    ``ctx - (hi - lo)`` tokens already cached."""

    lo: int
    hi: int
    ctx: int
    block_size: int
    blocks: Tensor  # [ceil(ctx / block_size)] block ids
    mask: Tensor  # [hi - lo, ctx]: row i sees keys 0 .. ctx - (hi - lo) + i


class ReferenceAttention:
    """Paged attention: gather each sequence's KV blocks, then causal SDPA.

    For sequence b with context ``L_b`` and new rows i (positions ``L_b - q_len_b + i``):
    ``out[i] = softmax(scale * q_i K_b[:p_i + 1]^T) V_b[:p_i + 1]``, where ``K_b``/``V_b`` are
    b's cache entries in block-table order and ``p_i`` is row i's position.

    Decode rows (one new token per sequence) are batched in groups. With ``group_bytes``
    None every decode forms one group (one gather, one SDPA). Otherwise the sequences are
    sorted by context length and cut into groups whose gathered keys (sequences x longest
    context in whole blocks x Hkv x D x the bytes of ``decode_dtype``) fit in ``group_bytes``; the groups and
    their index tensors are built once per step and reused by every layer. Each group gathers whole
    blocks into a padded ``[G, Hkv, L_max, D]`` tensor and runs one SDPA that masks every row
    to its own context length. Small groups do two things on a CPU: the copy stays in cache
    for the SDPA that reads it right after, and each group pads only to its own longest
    context. Prefill chunks (several new tokens) run one SDPA each, with the causal mask
    offset by the tokens already cached: row i of a q_len-token chunk sees keys
    ``0 .. ctx - q_len + i``.

    ``decode_in_float32`` (the CPU backend sets it): decode groups of a bfloat16 or float16 model
    compute in float32, each gathered block converted once, and round the output to the model's
    dtype. torch's CPU SDPA kernel is slow on bf16 decode rows: 1.6 ms for a call that float32
    does in 0.23 ms (24 sequences, 16 heads of 64, 40 keys; 2-core AMD EPYC), and a hidden-1024 bf16
    engine ran 1.26-1.29x faster with it (in turn) (docs/benchmarks.md, "bfloat16 weights"). ``group_bytes`` then
    counts the float32 K that SDPA reads (4 bytes a value). Float32 models are unaffected. Prefill
    chunks keep the model's dtype (their bf16 SDPA timed within 1.35x of float32).
    """

    def __init__(self, group_bytes: Optional[int] = None, decode_in_float32: bool = False) -> None:
        if group_bytes is not None and group_bytes <= 0:
            raise ValueError(f"group_bytes must be positive or None, got {group_bytes}")
        self.group_bytes = group_bytes
        self.decode_in_float32 = decode_in_float32
        self._plan: Optional[tuple[AttentionMeta, list[_DecodeGroup], list[_PrefillChunk]]] = None

    def paged_attention(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMeta, scale: float) -> Tensor:
        kv_cache[0].index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))
        out = torch.empty_like(q)
        decode_groups, prefill_chunks = self._step_plan(q.device, kv_cache, meta)
        for group in decode_groups:
            self._decode_group(q, kv_cache, group, scale, out)
        for chunk in prefill_chunks:
            self._prefill_chunk(q, kv_cache, chunk, scale, out)
        return out

    def decode_groups(self, seqs: list[int], context_lens: Sequence[int], bytes_per_position: int, block_size: int = 1) -> list[list[int]]:
        """``seqs`` cut into groups, shortest contexts first, each gathering at most ``group_bytes``
        of K: sequences x longest context rounded up to whole blocks x ``bytes_per_position``
        (a sequence over the budget on its own is a group of one)."""
        if not seqs:
            return []
        if self.group_bytes is None:
            return [seqs]
        groups: list[list[int]] = [[]]
        for b in sorted(seqs, key=lambda b: context_lens[b]):
            gathered = -(-context_lens[b] // block_size) * block_size * bytes_per_position
            if groups[-1] and (len(groups[-1]) + 1) * gathered > self.group_bytes:
                groups.append([])
            groups[-1].append(b)
        return groups

    def decode_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a decode group's SDPA runs in for queries and cache of ``dtype``: float32 for
        bf16/fp16 when ``decode_in_float32``, else ``dtype``. Group budgets count its bytes."""
        return torch.float32 if self.decode_in_float32 and dtype in (torch.bfloat16, torch.float16) else dtype

    @staticmethod
    def _gqa(x: Tensor, groups: int, dim: int) -> Tensor:
        return x.repeat_interleave(groups, dim=dim) if groups > 1 else x

    @staticmethod
    def _block_view(half: Tensor, block_size: int) -> Tensor:
        """One cache half ``[N, Hkv, D]`` as ``[N / block_size, block_size, Hkv, D]`` (no copy)."""
        return half.view(-1, block_size, *half.shape[1:])

    def _step_plan(self, device: torch.device, kv_cache: Tensor, meta: AttentionMeta) -> tuple[list["_DecodeGroup"], list["_PrefillChunk"]]:
        """The step's decode groups and prefill chunks with their index tensors and masks, built
        once per step: every layer gets the same ``meta`` (the last plan is kept and reused while
        ``meta`` is the same object; the grouping only sets how the work is cut, so any plan for
        ``meta`` gives the same output)."""
        cached = self._plan  # one read: (meta, decode groups, prefill chunks) is replaced as a whole
        if cached is not None and cached[0] is meta:
            return cached[1], cached[2]
        qs, bs = meta.host_query_starts, meta.block_size
        decodes = [b for b in range(meta.num_seqs) if qs[b + 1] - qs[b] == 1]
        plan = []
        per_position = kv_cache[0, 0].numel() * self.decode_dtype(kv_cache.dtype).itemsize
        for seqs in self.decode_groups(decodes, meta.host_context_lens, per_position, bs):
            ctx = [meta.host_context_lens[b] for b in seqs]
            width = max(ctx)
            n_blocks = (width + bs - 1) // bs
            sel = torch.tensor(seqs, device=device)
            mask = None
            if min(ctx) < width:
                lens = torch.tensor(ctx, device=device)
                mask = (torch.arange(width, device=device)[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
            plan.append(_DecodeGroup(
                width=width,
                block_size=bs,
                n_blocks=n_blocks,
                # Whole blocks: one contiguous copy of block_size rows each. Padding entries (block 0
                # past a table's end, or rows past a context) are masked out.
                blocks=meta.block_tables.index_select(0, sel)[:, :n_blocks].reshape(-1).long(),  # int64: every device's index_select takes it
                mask=mask,
                rows=torch.tensor([qs[b] for b in seqs], device=device),
            ))
        chunks = []
        for b in range(meta.num_seqs):
            lo, hi, ctx = qs[b], qs[b + 1], meta.host_context_lens[b]
            if hi - lo > 1:
                pos_q = torch.arange(ctx - (hi - lo), ctx, device=device)[:, None]
                chunks.append(_PrefillChunk(
                    lo=lo, hi=hi, ctx=ctx, block_size=bs,
                    blocks=torch.tensor(meta.host_block_tables[b][: (ctx + bs - 1) // bs], device=device),
                    mask=torch.arange(ctx, device=device)[None, :] <= pos_q,  # [q_len, ctx]
                ))
        self._plan = (meta, plan, chunks)
        return plan, chunks

    def _decode_group(self, q: Tensor, kv_cache: Tensor, group: "_DecodeGroup", scale: float, out: Tensor) -> None:
        n, bs = len(group.rows), group.block_size
        hkv, d = kv_cache.shape[2], q.shape[2]
        heads_per_kv = q.shape[1] // hkv
        dtype = self.decode_dtype(q.dtype)
        keys, vals = (  # converted while still whole contiguous blocks (a strided conversion is slower)
            self._block_view(half, bs).index_select(0, group.blocks).to(dtype).view(n, group.n_blocks * bs, hkv, d)[:, : group.width].transpose(1, 2)
            for half in kv_cache
        )  # [B, Hkv, L, D]
        # GQA without repeating K/V: one query token per sequence, so the query heads that
        # share kv head h are that many query rows against that head's keys.
        qb = q.index_select(0, group.rows).to(dtype).view(n, hkv, heads_per_kv, d)  # [B, Hkv, G, D]
        ob = F.scaled_dot_product_attention(qb, keys, vals, attn_mask=group.mask, scale=scale)  # [B, Hkv, G, D]
        out.index_copy_(0, group.rows, ob.reshape(n, hkv * heads_per_kv, d).to(out.dtype))

    def _prefill_chunk(self, q: Tensor, kv_cache: Tensor, chunk: "_PrefillChunk", scale: float, out: Tensor) -> None:
        groups = q.shape[1] // kv_cache.shape[2]
        keys, vals = (
            self._gqa(self._block_view(half, chunk.block_size).index_select(0, chunk.blocks).flatten(0, 1)[: chunk.ctx].transpose(0, 1), groups, 0).to(q.dtype)
            for half in kv_cache
        )  # [Hq, ctx, D]
        qb = q[chunk.lo : chunk.hi].transpose(0, 1)  # [Hq, q_len, D]
        # A batch of one: SDPA's fused kernels (the CPU's flash kernel) take only 4-D operands; 3-D
        # ones ran its math path, 2x slower on a 24-token prompt (69 against 35 us, 8 heads of 64).
        attended = F.scaled_dot_product_attention(qb[None], keys[None], vals[None], attn_mask=chunk.mask, scale=scale)[0]
        out[chunk.lo : chunk.hi] = attended.transpose(0, 1)


class ReferenceBackend:
    """The CPU backend: pure torch, the ground truth."""

    name = "cpu"

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.lora = ReferenceLoRAOps()
        self.attention = ReferenceAttention(group_bytes=CPU_ATTENTION_GROUP_BYTES, decode_in_float32=True)

    @staticmethod
    def availability() -> tuple[bool, str]:
        return True, "pure torch, always available"

    def synchronize(self) -> None:
        return None
