"""The reference (cpu) LoRA ops and paged attention against float64 loops on fresh random inputs.

Grid for LoRA: schedule (segment / per-token, called directly and through
ReferenceLoRAOps, and the in-place row-range path for adapter-ordered steps) x adapter
popularity (identical, distinct, uniform, zipf, skewed) x dtype x A layout (one buffer
per slice, or interleaved across a fused projection's slices), every batch mixing ranks {4, 8, 16}, rank-0 slices (adapter not targeting a
slice), and rows with no adapter, over a 3-slice fused projection.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import random
import zlib

import pytest
import torch

from backends.reference import (
    ReferenceAttention,
    ReferenceLoRAOps,
    SlotViews,
    apply_row_ranges,
    expand_per_token,
    expand_segment,
    shrink_per_token,
    shrink_segment,
)
from runtime.backend_api import apply_lora
from runtime.kv.attention_meta import AttentionMeta
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights
from tests.op_argument_cases import assert_bad_arguments_refused, assert_good_arguments_applied

IN, OUTS, SLOTS, MAX_RANK = 32, (32, 16, 24), 6, 16
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def popularity_slots(kind: str, gen: torch.Generator) -> list[int]:
    t = 20
    if kind == "identical":
        slots = [3] * t
    elif kind == "distinct":
        slots = torch.randperm(SLOTS, generator=gen).tolist() * 2 + [-1] * 2
        return slots  # every slot once per half, plus two base rows
    elif kind == "uniform":
        slots = torch.randint(0, SLOTS, (t,), generator=gen).tolist()
    elif kind == "zipf":
        p = torch.tensor([1.0 / (k + 1) ** 1.2 for k in range(SLOTS)])
        slots = torch.multinomial(p, t, replacement=True, generator=gen).tolist()
    elif kind == "skewed":
        slots = [0 if u < 0.8 else int(v) for u, v in zip(torch.rand(t, generator=gen).tolist(), torch.randint(1, SLOTS, (t,), generator=gen).tolist())]
    else:
        raise ValueError(kind)
    base = torch.rand(t, generator=gen) < 0.25  # some rows use no adapter
    return [-1 if b else s for s, b in zip(slots, base.tolist())]


LAYOUTS = ("separate", "interleaved", "interleaved_uneven")


def make_weights(dtype: torch.dtype, gen: torch.Generator, layout: str = "separate"):
    """3 slices; each slot has its own rank per slice (0 = slice untouched). Returns (weights, host copy).

    layout: one A buffer per slice; A rows interleaved across the slices
    (``allocate_projection(..., interleaved=True)``), each slot's slices starting at one row as the pool
    writes them; or interleaved with every slice of a slot at its own start row (the
    one-matmul shrink does not apply and the ops must notice). Unused rows hold finite
    garbage, which no schedule may read."""
    rank_choices = [4, 8, 16]
    ranks = [[rank_choices[(s + i) % 3] for i in range(len(OUTS))] for s in range(SLOTS)]
    ranks[1][2] = 0  # slot 1 does not target slice 2
    ranks[4] = [0, 8, 0]  # slot 4 targets only slice 1
    per_slot = [max(r) + (len(OUTS) if layout == "interleaved_uneven" else 0) for r in ranks]
    capacity = sum(per_slot)
    if layout == "separate":
        weights = [LoRASliceWeights.allocate(IN, out, SLOTS, capacity, dtype, "cpu") for out in OUTS]
    else:
        weights = LoRASliceWeights.allocate_projection(IN, OUTS, SLOTS, capacity, dtype, "cpu", interleaved=True)
    for w in weights:
        w.a_rows.copy_(torch.randn(w.a_rows.shape, generator=gen) * 100)
        w.b_rows.copy_(torch.randn(w.b_rows.shape, generator=gen) * 100)
    host = {}
    start = 0
    for s in range(SLOTS):
        for i, out in enumerate(OUTS):
            r = ranks[s][i]
            if r == 0:
                weights[i].clear_slot(s)
                continue
            a = torch.randn(r, IN, generator=gen).to(dtype)
            b = torch.randn(out, r, generator=gen).to(dtype)
            scale = float(torch.rand(1, generator=gen)) * 2 + 0.25
            weights[i].write_slot(s, start + (i if layout == "interleaved_uneven" else 0), a, b, scale)
            host[(s, i)] = (a.double(), b.double(), scale)
        start += per_slot[s]
    return weights, host


def loop_reference(x: torch.Tensor, y: torch.Tensor, slots: list[int], host) -> torch.Tensor:
    """float64: y[t, slice i] += scale * x[t] @ A^T @ B^T, one row at a time."""
    out = y.double().clone()
    offs = [0, OUTS[0], OUTS[0] + OUTS[1]]
    for t, s in enumerate(slots):
        for i in range(len(OUTS)):
            if s < 0 or (s, i) not in host:
                continue
            a, b, scale = host[(s, i)]
            out[t, offs[i] : offs[i] + OUTS[i]] += scale * (x[t].double() @ a.t()) @ b.t()
    return out


SCHEDULES = {
    "segment": (shrink_segment, expand_segment, False),
    "per_token": (shrink_per_token, expand_per_token, True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("popularity", ["identical", "distinct", "uniform", "zipf", "skewed"])
@pytest.mark.parametrize("schedule", ["segment", "per_token", "dispatch_prefill", "dispatch_decode", "row_ranges"])
def test_lora_ops_match_float64_loop(schedule, popularity, dtype, layout):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{schedule}/{popularity}/{dtype}/{layout}".encode()))
    weights, host = make_weights(dtype, gen, layout)
    slots = popularity_slots(popularity, gen)
    if schedule == "row_ranges":  # rows grouped by slot, as the model runner orders them; base rows on both sides
        base = [s for s in slots if s < 0]
        slots = base[: len(base) // 2] + sorted(s for s in slots if s >= 0) + base[len(base) // 2 :]
    t = len(slots)
    x = torch.randn(t, IN, generator=gen).to(dtype)
    y = torch.randn(t, sum(OUTS), generator=gen).to(dtype)
    expected = loop_reference(x, y, slots, host)
    y_before = y.clone()
    offsets = [0, OUTS[0], OUTS[0] + OUTS[1]]
    # finite garbage in the workspace: entries past a row's rank must not change the result
    work = torch.randn(len(OUTS), t, MAX_RANK, generator=gen) * 100
    if schedule in SCHEDULES:
        shrink, expand, decode = SCHEDULES[schedule]
        meta = LoRABatchMeta.build(slots, "cpu", decode_only=decode)
        shrink(x, weights, meta, work)
        expand(work, weights, meta, y, offsets)
    else:
        meta = LoRABatchMeta.build(slots, "cpu", decode_only=schedule == "dispatch_decode")
        if schedule == "row_ranges":
            assert meta.first_row == next(i for i, s in enumerate(slots) if s >= 0), "the grouped rows are one run"
        apply_lora(ReferenceLoRAOps(), x, y, weights, meta, offsets, work)
    scale = expected.abs().max()
    err = (y.double() - expected).abs().max() / scale
    assert err < TOL[dtype], f"relative error {err:.2e}"
    base_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(y[base_rows], y_before[base_rows]), "rows without an adapter must be left bit-exact"
    if popularity != "identical":
        assert base_rows, "the grid must include rows without an adapter"


@pytest.mark.parametrize(
    "slots, first_row",
    [
        ([2, 2, 0, -1], None),  # slot 0's row comes after slot 2's: not in slot order
        ([0, -1, 0, 1], None),  # a base row splits the run
        ([-1, 0, 0, 3, -1], 1),
        ([1, 1, 1], 0),
        ([-1, -1], None),  # no adapter rows at all
    ],
)
def test_batch_meta_first_row_marks_one_run_in_slot_order(slots, first_row):
    assert LoRABatchMeta.build(slots, "cpu").first_row == first_row


def test_batch_meta_device_arrays_are_16_byte_aligned_and_exact():
    """Triton specializes kernels on 16-byte pointer alignment: every packed section must start
    aligned whatever the batch, or each alignment pattern compiles its own kernel variant."""
    rng = random.Random(7)
    for _ in range(200):
        slots = [rng.choice([-1, 0, 1, 2, 5]) for _ in range(rng.randint(1, 23))]
        meta = LoRABatchMeta.build(slots, "cpu")
        arrays = (meta.token_slots, meta.sorted_tokens, meta.seg_slots, meta.seg_starts)
        assert all(a.data_ptr() % 16 == 0 for a in arrays if a.numel()), slots
        order = sorted((i for i, s in enumerate(slots) if s != -1), key=lambda i: slots[i])
        assert meta.token_slots.tolist() == slots and meta.sorted_tokens.tolist() == order
        assert meta.seg_slots.tolist() == list(meta.host_seg_slots) and meta.seg_starts.tolist() == list(meta.host_seg_starts)
        assert meta.seg_tiles is not None and meta.seg_tiles.data_ptr() % 16 == 0 or meta.num_tiles == 0


def test_seg_tiles_cover_every_segment_in_runs_of_at_most_64_rows():
    meta = LoRABatchMeta.build([2] * 150 + [-1] + [0] * 3 + [5] * 64 + [5] * 1, "cpu")
    assert meta.host_seg_starts == (0, 3, 153, 218)  # slot 0: 3 rows, slot 2: 150, slot 5: 65
    pairs = meta.seg_tiles.view(-1, 2).tolist()
    assert pairs == [[0, 0], [1, 3], [1, 67], [1, 131], [2, 153], [2, 217]] and meta.num_tiles == 6
    assert LoRABatchMeta.build([-1, -1], "cpu").num_tiles == 0


def test_shrink_writes_only_rows_with_an_adapter():
    gen = torch.Generator().manual_seed(7)
    weights, _ = make_weights(torch.float32, gen)
    slots = [0, -1, 4, -1, 2]
    x = torch.randn(len(slots), IN, generator=gen)
    for shrink, _, decode in SCHEDULES.values():
        work = torch.full((len(OUTS), len(slots), MAX_RANK), 123.0)
        shrink(x, weights, LoRABatchMeta.build(slots, "cpu", decode_only=decode), work)
        assert torch.all(work[:, [1, 3]] == 123.0)
        assert torch.all(work[0, 2] == 123.0) and torch.all(work[2, 2] == 123.0)  # slot 4 has rank 0 there


# ---- paged attention ----------------------------------------------------------------------


def dense_causal(q, keys, vals, q_offset: int, scale: float) -> torch.Tensor:
    """float64: q [q_len, Hq, D], keys/vals [ctx, Hkv, D]; row i sees keys 0 .. q_offset + i."""
    hq, hkv = q.shape[1], keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        for h in range(hq):
            kh = h // (hq // hkv)
            k = keys[: q_offset + i + 1, kh].double()
            v = vals[: q_offset + i + 1, kh].double()
            w = torch.softmax((k @ q[i, h].double()) * scale, dim=0)
            out[i, h] = w @ v
    return out


# Decode groups per case: (sequences by their index in ``seqs`` below, masked) in run order.
# Decodes are sequences 2..6 with contexts 9, 8, 12, 8, 14 (12, 8, 12, 8, 16 in whole blocks of 4).
EXPECTED_GROUPS = {
    None: [([2, 3, 4, 5, 6], True)],  # one group, in step order, padded to 14 and masked
    1: [([3], False), ([5], False), ([2], False), ([4], False), ([6], False)],  # alone, shortest first
    16: [([3, 5], False), ([2], False), ([4], False), ([6], False)],  # the 8s together (2 x 8), 12 > 16 / 2
    28: [([3, 5], False), ([2, 4], True), ([6], False)],  # 3 x 12 > 28 >= 2 x 12; 9 vs 12 masked; 2 x 16 > 28
}


@pytest.mark.parametrize("group_positions", [None, 1, 16, 28], ids=["one-group", "alone", "equal-pairs", "padded-groups"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_matches_dense_float64(dtype, group_positions):
    """Decode groups (``group_bytes`` in positions of this cache, contexts counted in whole
    blocks of 4): one padded group; every sequence alone (no mask); 16 positions: the two
    8-token contexts together (equal lengths, no mask), 9, 12, 14 alone; 28: (8, 8), then
    (9, 12) padded and masked, then 14 (``EXPECTED_GROUPS``, checked on the plan the call used;
    counted in single positions instead of whole blocks, 28 would give (8, 8, 9) and (12, 14))."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, bs, n_blocks = 4, 2, 8, 4, 40
    # (new tokens, context): plain prefill, chunked prefill (history in the cache), decodes, two at a block edge
    seqs = [(5, 5), (3, 11), (1, 9), (1, 8), (1, 12), (1, 8), (1, 14)]
    perm = torch.randperm(n_blocks, generator=gen).tolist()  # scattered, non-contiguous blocks
    tables, used = [], 0
    for _, ctx in seqs:
        need = math.ceil(ctx / bs) + 1  # one spare block at the end of each table
        tables.append(perm[used : used + need])
        used += need
    cache = torch.randn(2, n_blocks * bs, hkv, d, generator=gen).to(dtype)  # garbage everywhere
    full_k, full_v = [], []
    for (q_len, ctx), table in zip(seqs, tables):
        k = torch.randn(ctx, hkv, d, generator=gen).to(dtype)
        v = torch.randn(ctx, hkv, d, generator=gen).to(dtype)
        for pos in range(ctx - q_len):  # history already in the cache
            flat = table[pos // bs] * bs + pos % bs
            cache[0, flat], cache[1, flat] = k[pos], v[pos]
        full_k.append(k)
        full_v.append(v)
    q_lens = [q for q, _ in seqs]
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    new_k = torch.cat([k[ctx - ql :] for k, (ql, ctx) in zip(full_k, seqs)])
    new_v = torch.cat([v[ctx - ql :] for v, (ql, ctx) in zip(full_v, seqs)])
    meta = AttentionMeta.build(q_lens, [c for _, c in seqs], tables, bs)
    scale = d**-0.5
    attention = ReferenceAttention(None if group_positions is None else group_positions * hkv * d * cache.element_size())
    cache_before = cache.clone()
    out = attention.paged_attention(q, new_k, new_v, cache, meta, scale)
    plan_meta, groups, chunks = attention._plan
    assert plan_meta is meta
    qs = meta.host_query_starts
    got = [(g.rows.tolist(), g.mask is not None) for g in groups]
    assert got == [([qs[b] for b in seqs], masked) for seqs, masked in EXPECTED_GROUPS[group_positions]]
    assert [(c.lo, c.hi) for c in chunks] == [(0, 5), (5, 8)]  # the two prefills, one SDPA each
    start = 0
    for b, (q_len, ctx) in enumerate(seqs):
        expected = dense_causal(q[start : start + q_len], full_k[b], full_v[b], ctx - q_len, scale)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[start : start + q_len].double(), expected, rtol=tol, atol=tol)
        start += q_len
    # the new K/V landed in the cache at slot_mapping, and nowhere else
    assert torch.equal(cache[0].index_select(0, meta.slot_mapping), new_k)
    assert torch.equal(cache[1].index_select(0, meta.slot_mapping), new_v)
    untouched = torch.ones(cache.shape[1], dtype=torch.bool)
    untouched[meta.slot_mapping] = False
    assert torch.equal(cache[:, untouched], cache_before[:, untouched])


def test_step_plan_is_shared_by_a_steps_layers_and_rebuilt_for_the_next_step():
    """The plan (decode groups, prefill chunks) is kept for the step's ``meta``: every layer (its own cache, its own
    q/k/v, same meta) must still get its own right answer, in fp32 and then bf16 with the
    same meta, and a new step (new meta, other lengths and tables) must not reuse the plan."""
    from types import SimpleNamespace

    from runtime.verifiers.attention_problem import check_attention, random_cache, random_step

    gen = torch.Generator().manual_seed(23)
    backend = SimpleNamespace(attention=ReferenceAttention(group_bytes=16 * 2 * 16 * 4), synchronize=lambda: None)  # 16 fp32 positions per group
    steps = [
        random_step([1, 1, 1, 3], [5, 9, 6, 7], [[0, 1], [2, 3, 4], [5, 6], [7, 8]], torch.float32, torch.device("cpu"), gen),
        random_step([1, 1, 1], [13, 3, 11], [[9, 10, 11, 12], [13], [14, 15, 0]], torch.float32, torch.device("cpu"), gen),
    ]
    plans = []
    for n, step in enumerate(steps):
        for dtype in (torch.float32, torch.float32, torch.bfloat16):  # two layers, then a bf16 cache
            s = dataclasses.replace(step, q=step.q.to(dtype), k=step.k.to(dtype), v=step.v.to(dtype))
            check_attention(backend, s, random_cache(16, dtype, torch.device("cpu"), gen), dtype, f"plan reuse {dtype}")
            if len(plans) == n:  # the step's first layer builds its plan
                plans.append(backend.attention._plan)
                assert plans[-1][0] is step.meta and (n == 0 or plans[-1] is not plans[-2])
            else:  # its later layers use that very plan, not a rebuilt one
                assert backend.attention._plan is plans[-1]
    # Step 1: decodes with contexts 5 and 6 (8 positions each in blocks) together, 9 alone; one prefill.
    # Step 2: contexts 3, 11, 13 (4, 12, 16 in blocks), every decode alone; no prefill.
    assert [[g.rows.tolist() for g in plan[1]] for plan in plans] == [[[0, 2], [1]], [[1], [2], [0]]]
    assert [[(c.lo, c.hi) for c in plan[2]] for plan in plans] == [[(3, 6)], []]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_groups_compute_in_float32_when_asked(dtype):
    """``decode_in_float32`` (the CPU backend's): a bf16/fp16 step's decode rows are exactly the
    float32 computation on the same (rounded) cache and queries, rounded once; its prefill rows,
    and every row without the flag, are the model dtype's own SDPA, unchanged."""
    from runtime.verifiers.attention_problem import random_cache, random_step

    gen = torch.Generator().manual_seed(29)
    step = random_step([1, 3, 1, 1], [9, 7, 13, 4], [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9]], torch.float32, torch.device("cpu"), gen)
    half = dataclasses.replace(step, q=step.q.to(dtype), k=step.k.to(dtype), v=step.v.to(dtype))
    cache = random_cache(16, dtype, torch.device("cpu"), gen)
    upcast = ReferenceAttention(decode_in_float32=True).paged_attention(half.q, half.k, half.v, cache.clone(), half.meta, half.scale)
    plain = ReferenceAttention().paged_attention(half.q, half.k, half.v, cache.clone(), half.meta, half.scale)
    in_fp32 = ReferenceAttention().paged_attention(half.q.float(), half.k.float(), half.v.float(), cache.float(), half.meta, half.scale)
    decodes, prefill = [0, 4, 5], [1, 2, 3]  # rows: seq 0, seq 1's three new tokens, seqs 2 and 3
    assert upcast.dtype == dtype and torch.equal(upcast[decodes], in_fp32[decodes].to(dtype))
    assert torch.equal(upcast[prefill], plain[prefill])
    # the float32 rows are at least as close to float64 as the model dtype's own
    want = ReferenceAttention().paged_attention(half.q.double(), half.k.double(), half.v.double(), cache.double(), half.meta, half.scale)
    assert (upcast[decodes].double() - want[decodes]).abs().max() <= (plain[decodes].double() - want[decodes]).abs().max() + 1e-3
    f32 = ReferenceAttention(decode_in_float32=True).paged_attention(step.q, step.k, step.v, cache.float(), step.meta, step.scale)
    assert torch.equal(f32, ReferenceAttention().paged_attention(step.q, step.k, step.v, cache.float(), step.meta, step.scale))


def test_upcast_decode_groups_count_float32_bytes():
    """The group budget counts the K that SDPA reads: with ``decode_in_float32`` a bf16 cache's
    groups are those of a float32 cache under the same budget."""
    from runtime.verifiers.attention_problem import random_cache, random_step

    gen = torch.Generator().manual_seed(31)
    step = random_step([1, 1, 1, 1], [9, 7, 13, 4], [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9]], torch.float32, torch.device("cpu"), gen)
    budget = 2 * 16 * 2 * 8 * 4  # two 16-position contexts of float32 K (random_step: 2 kv heads of 8)
    plans = {}
    for name, dtype, upcast in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False), ("bf16 upcast", torch.bfloat16, True)):
        attention = ReferenceAttention(budget, decode_in_float32=upcast)
        s = dataclasses.replace(step, q=step.q.to(dtype), k=step.k.to(dtype), v=step.v.to(dtype))
        attention.paged_attention(s.q, s.k, s.v, random_cache(16, dtype, torch.device("cpu"), gen), s.meta, s.scale)
        plans[name] = [g.rows.tolist() for g in attention._plan[1]]
    assert plans["bf16 upcast"] == plans["fp32"] != plans["bf16"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bf16", "fp64"])
def test_row_ranges_leave_columns_no_slice_covers_bit_exact(dtype):
    """Non-float32 rows go through float32 copies; only the slices' columns are written back."""
    gen = torch.Generator().manual_seed(37)
    weights, host = make_weights(dtype, gen, LAYOUTS[0])
    slots = [-1, 0, 0, 2, 3, 5, -1]
    meta = LoRABatchMeta.build(slots, "cpu", decode_only=True)
    offsets = [0, OUTS[0], OUTS[0] + OUTS[1]]
    x = torch.randn(len(slots), IN, generator=gen).to(dtype)
    y = torch.randn(len(slots), sum(OUTS) + 5, generator=gen, dtype=torch.float64).to(dtype)  # 5 columns past the slices
    before = y.clone()
    apply_lora(ReferenceLoRAOps(), x, y, weights, meta, offsets, torch.zeros(len(OUTS), len(slots), MAX_RANK))
    assert torch.equal(y[:, sum(OUTS) :], before[:, sum(OUTS) :]) and not torch.equal(y, before)
    expected = loop_reference(x, before[:, : sum(OUTS)], slots, {k: tuple(t.to(dtype).double() if torch.is_tensor(t) else t for t in v) for k, v in host.items()})
    assert ((y[:, : sum(OUTS)].double() - expected).abs().max() / expected.abs().max()) < TOL.get(dtype, 1e-6)


def test_the_cpu_backend_decodes_half_precision_in_float32():
    from backends.reference import ReferenceBackend

    assert ReferenceBackend().attention.decode_in_float32 and not ReferenceAttention().decode_in_float32


def test_decode_groups_sorted_and_within_budget():
    """Every decode lands in exactly one group; groups run shortest contexts first; a group
    of several fits the budget (sequences x longest context x bytes per position)."""
    rng = random.Random(5)
    for _ in range(200):
        context_lens = [rng.randint(1, 700) for _ in range(rng.randint(1, 40))]
        seqs = [b for b in range(len(context_lens)) if rng.random() < 0.8]
        budget = rng.choice([1, 512, 4096, 1 << 16])
        bs = rng.choice([1, 4, 16])
        groups = ReferenceAttention(budget).decode_groups(seqs, context_lens, bytes_per_position=8, block_size=bs)
        assert sorted(b for g in groups for b in g) == sorted(seqs)
        flat = [context_lens[b] for g in groups for b in g]
        assert flat == sorted(flat)
        gathered = {b: math.ceil(context_lens[b] / bs) * bs * 8 for b in seqs}  # whole blocks are copied
        for g in groups:
            if len(g) > 1:
                assert len(g) * max(gathered[b] for b in g) <= budget
        # greedy: the next group's first sequence would not have fitted in the previous group
        for prev, nxt in zip(groups, groups[1:]):
            assert (len(prev) + 1) * gathered[nxt[0]] > budget
    assert ReferenceAttention(None).decode_groups([3, 1, 2], [5, 6, 7, 8], 8) == [[3, 1, 2]]
    assert ReferenceAttention(64).decode_groups([], [], 8) == []
    with pytest.raises(ValueError, match="group_bytes"):
        ReferenceAttention(0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_ranges_see_slot_rewrites(layout, dtype):
    """The row-range path caches per-slot views (bf16: float32 copies of them); rewriting a slot
    (new rank, weights, scale), clearing one, or swapping a buffer must show in the very next call."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"rewrite/{layout}".encode()))
    weights, host = make_weights(dtype, gen, layout)
    slots = [-1, 0, 0, 2, 2, 2, 3, 5, -1]
    meta = LoRABatchMeta.build(slots, "cpu", decode_only=True)
    assert meta.first_row == 1
    offsets = [0, OUTS[0], OUTS[0] + OUTS[1]]
    x = torch.randn(len(slots), IN, generator=gen).to(dtype)
    work = torch.zeros(len(OUTS), len(slots), MAX_RANK)

    def check() -> None:
        y = torch.randn(len(slots), sum(OUTS), generator=gen).to(dtype)
        expected = loop_reference(x, y, slots, {k: tuple(t.to(dtype).double() if torch.is_tensor(t) else t for t in v) for k, v in host.items()})
        apply_lora(ReferenceLoRAOps(), x, y, weights, meta, offsets, work)
        assert ((y.double() - expected).abs().max() / expected.abs().max()) < TOL[dtype]

    check()
    starts = [w.host_start[2] for w in weights]  # slot 2 gets new weights, rank 4 on every slice (was 4/8/16)
    for i, out in enumerate(OUTS):
        a, b = torch.randn(4, IN, generator=gen).to(dtype), torch.randn(out, 4, generator=gen).to(dtype)
        weights[i].write_slot(2, starts[i], a, b, 0.5)
        host[(2, i)] = (a.double(), b.double(), 0.5)
    for i in range(len(OUTS)):
        weights[i].clear_slot(3)
        host.pop((3, i), None)
    check()
    # Reallocated buffers must not leave stale views behind, nor (interleaved layouts) a
    # shrink that still reads the shared A buffer the slice no longer uses.
    weights[1].b_rows = weights[1].b_rows.clone()
    weights[1].b_rows[starts[1] : starts[1] + 4].zero_()
    host[(2, 1)] = (host[(2, 1)][0], torch.zeros_like(host[(2, 1)][1]), 0.5)
    check()
    weights[0].a_rows = weights[0].a_rows.clone()
    weights[0].a_rows[starts[0] : starts[0] + 4].zero_()
    host[(2, 0)] = (torch.zeros_like(host[(2, 0)][0]), host[(2, 0)][1], 0.5)
    check()
    # New memory under the same tensor object (set_): the same object, other rows.
    fresh = weights[2].b_rows.clone()
    fresh[starts[2] : starts[2] + 4].zero_()
    weights[2].b_rows.set_(fresh)
    host[(2, 2)] = (host[(2, 2)][0], torch.zeros_like(host[(2, 2)][1]), 0.5)
    check()
    # A shallow copy shares the buffers and host tables but not the version counter: a
    # rescale written through it must still reach the original's next call.
    for i, w in enumerate(weights):
        twin = copy.copy(w)
        if w.host_rank[5]:
            a, b, _ = host[(5, i)]
            twin.write_slot(5, w.host_start[5], w.a_rows[w.host_start[5] : w.host_start[5] + w.host_rank[5]].clone(),
                            w.b_rows[w.host_start[5] : w.host_start[5] + w.host_rank[5]].t().clone(), 3.0)  # fmt: skip
            host[(5, i)] = (a, b, 3.0)
    check()
    # New weights written through a shallow copy, slot tables unchanged (same start, rank and
    # scale): only the buffers' contents change, and the next call must use them.
    for i, w in enumerate(weights):
        if w.host_rank[5]:
            r, start = w.host_rank[5], w.host_start[5]
            a, b = torch.randn(r, IN, generator=gen).to(dtype), torch.randn(OUTS[i], r, generator=gen).to(dtype)
            copy.copy(w).write_slot(5, start, a, b, 3.0)
            host[(5, i)] = (a.double(), b.double(), 3.0)
    check()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_slot_views_outlive_writes_to_other_slots(layout):
    """A slot write drops the cached views of that slot only (float32: views read the rows as they
    are now), and so it does for the float32 copies of a bf16 pool, since ``write_slot`` logs the
    rows it writes; a write to the rows that ``write_slot`` did not make drops every copy, no view."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"keep/{layout}".encode()))
    meta = LoRABatchMeta.build([0, 2, 2, 3, 5], "cpu", decode_only=True)
    offsets = [0, OUTS[0], OUTS[0] + OUTS[1]]
    for dtype, copies in ((torch.float32, False), (torch.bfloat16, True)):
        weights, _ = make_weights(dtype, gen, layout)
        x, y = torch.randn(5, IN, generator=gen).to(dtype), torch.zeros(5, sum(OUTS), dtype=dtype)

        def apply() -> dict:
            apply_lora(ReferenceLoRAOps(), x, y, weights, meta, offsets, torch.zeros(len(OUTS), 5, MAX_RANK))
            return dict(SlotViews.cache_for(weights, as_float32=copies))

        before = apply()
        assert set(before) == {0, 2, 3, 5}
        for w in weights:  # slot 2 rewritten in place, same start, rank and scale
            r, start = w.host_rank[2], w.host_start[2]
            w.write_slot(2, start, torch.randn(r, IN, generator=gen).to(dtype), torch.randn(w.out_features, r, generator=gen).to(dtype), w.host_scale[2])
        for w in weights:
            w.clear_slot(3)
        after = SlotViews.cache_for(weights, as_float32=copies)
        kept = {0, 5} if copies else {0, 2, 5}  # a view of slot 2 reads its new rows; a copy of them would be stale
        assert set(after) == kept and all(after[s] is before[s] for s in kept)
        again = apply()
        assert again[3].slices == ()  # rebuilt: slot 3 now targets nothing
        # Slot 5's rows written through a shallow copy, tables unchanged: the copy shares the log.
        for w in weights:
            if w.host_rank[5]:
                r, start = w.host_rank[5], w.host_start[5]
                copy.copy(w).write_slot(5, start, torch.randn(r, IN, generator=gen).to(dtype), torch.randn(w.out_features, r, generator=gen).to(dtype), w.host_scale[5])
        after = SlotViews.cache_for(weights, as_float32=copies)
        kept = {0, 2, 3} if copies else {0, 2, 3, 5}
        assert set(after) == kept and all(after[s] is again[s] for s in kept)
        apply()
        weights[0].a_rows[0].add_(1)  # in place, not by write_slot: which copies it touched is not known
        after = SlotViews.cache_for(weights, as_float32=copies)
        assert set(after) == (set() if copies else {0, 2, 3, 5})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_row_ranges_cache_follows_random_writes(dtype):
    """The per-slot views and float32 copies that ``apply_row_ranges`` caches, against the buffers
    as they are: random sequences of slot writes (rows that may overlap other slots'), rewrites of
    the same rows, writes through shallow copies, clears, in-place writes to the rows and groups,
    buffer swaps (new tensors and ``set_``) and direct edits of the host tables. After each step
    the result must equal, bit for bit, the same call on slices with an empty cache, and a float64
    loop over the current buffers. (A per-slot invalidation of the copies that this broke was
    tried and not kept.)"""
    n_in, slots, cap = 16, 5, 40
    for seed in range(40):
        rng = random.Random(zlib.crc32(f"cache-fuzz/{dtype}/{seed}".encode()))
        gen = torch.Generator().manual_seed(seed)
        outs = rng.choice([(8, 8, 8), (8, 4, 4), (8, 8)])
        if rng.random() < 0.3:
            weights = [LoRASliceWeights.allocate(n_in, o, slots, cap, dtype, "cpu") for o in outs]
        else:
            weights = LoRASliceWeights.allocate_projection(n_in, list(outs), slots, cap, dtype, "cpu", interleaved=True)
        for w in weights:
            w.a_rows.copy_(torch.randn(w.a_rows.shape, generator=gen))
            w.b_rows.copy_(torch.randn(w.b_rows.shape, generator=gen))
        offsets = [sum(outs[:i]) for i in range(len(outs))]
        xy_dtype = rng.choice([dtype, torch.float32])

        def write(slot: int, same: bool = False, through_copy: bool = False) -> None:
            base, scale = rng.randrange(cap - 11), rng.choice([0.5, 1.0, 2.0])
            uneven = rng.random() < 0.3  # each slice of the slot at its own start row
            for i, w in enumerate(weights):
                target = copy.copy(w) if through_copy else w
                if same and w.host_rank[slot]:
                    r, start, scale = w.host_rank[slot], w.host_start[slot], w.host_scale[slot]
                elif same or rng.random() < 0.25:
                    w.clear_slot(slot)
                    continue
                else:
                    r, start = rng.choice([1, 2, 4, 8]), base + (i if uneven else 0)
                a = torch.randn(r, n_in, generator=gen).to(dtype)
                target.write_slot(slot, start, a, torch.randn(w.out_features, r, generator=gen).to(dtype), scale)

        def check() -> None:
            used = sorted(rng.sample(range(slots), rng.randint(1, slots)))
            rows = [-1] * rng.randint(0, 2) + [s for s in used for _ in range(rng.randint(1, 3))] + [-1] * rng.randint(0, 2)
            meta = LoRABatchMeta.build(rows, "cpu", decode_only=rng.random() < 0.5)
            x = torch.randn(len(rows), n_in, generator=gen).to(xy_dtype)
            y = torch.randn(len(rows), sum(outs), generator=gen).to(xy_dtype)
            cached, fresh = y.clone(), y.clone()
            apply_row_ranges(x, cached, weights, meta, offsets)
            apply_row_ranges(x, fresh, [dataclasses.replace(w, view_cache={}) for w in weights], meta, offsets)
            expected = y.double().clone()
            for t, s in enumerate(rows):
                for i, w in enumerate(weights):
                    if s >= 0 and w.host_rank[s]:
                        r, start = w.host_rank[s], w.host_start[s]
                        a, b = w.a_rows[start : start + r].double(), w.b_rows[start : start + r].double()
                        expected[t, offsets[i] : offsets[i] + w.out_features] += w.host_scale[s] * (x[t].double() @ a.t()) @ b
            assert torch.equal(cached, fresh), f"seed {seed}: the cache disagrees with a fresh one"
            err = ((cached.double() - expected).abs().max() / expected.abs().max().clamp(min=1)).item()
            assert err < (1e-4 if xy_dtype == torch.float32 else 2e-2), f"seed {seed}: relative error {err:.3g} against float64"

        for slot in range(slots):
            write(slot)
        originals = [(w.a_rows, w.b_rows) for w in weights]
        for _ in range(25):
            kind, slot, i = rng.randrange(9), rng.randrange(slots), rng.randrange(len(weights))
            w = weights[i]
            if kind in (0, 1, 2):
                write(slot, same=kind == 1, through_copy=kind == 2)
            elif kind == 3:
                for each in weights:
                    each.clear_slot(slot)
            elif kind == 4:  # in place on the rows or, interleaved, the group
                buffer = w.a_group if w.a_group is not None and rng.random() < 0.5 else rng.choice([w.a_rows, w.b_rows])
                lo = rng.randrange(cap - 4)
                buffer[lo : lo + 4] = rng.uniform(-2, 2)
            elif kind == 5:  # a new tensor, or new memory under the same one
                if rng.random() < 0.5:
                    w.b_rows = w.b_rows.clone()
                else:
                    w.b_rows.set_(w.b_rows.clone())
            elif kind == 6:
                w.a_rows, w.b_rows = originals[i]
            elif kind == 7 and w.host_rank[slot]:
                w.host_scale[slot] = rng.choice([0.25, 3.0])  # a table edited without _set_slot
            if kind == 8 or rng.random() < 0.4:
                check()
        check()


def test_slot_writes_outside_the_table_are_refused_before_writing():
    w = LoRASliceWeights.allocate(8, 4, 2, 16, torch.float32, "cpu")
    for slot in (2, -1):
        with pytest.raises(ValueError, match=rf"slot {slot} is not one of this slice's 2 slots"):
            w.write_slot(slot, 0, torch.ones(4, 8), torch.ones(4, 4), 1.0)
        with pytest.raises(ValueError, match=rf"slot {slot} is not one of"):
            w.clear_slot(slot)
    assert not w.a_rows.any() and not w.b_rows.any() and w.write_log == [0] and w.host_rank == [0, 0]


@pytest.mark.parametrize("case", ["slice_twice", "swapped_out", "copy_with_own_buffers", "in_place_alone"])
def test_a_logged_write_cannot_hide_an_unlogged_one(case):
    """The float32 copies of a bf16 pool outlive a logged write only if the logged writes account for
    every change of the buffers' version counters. A logged write that bumped other memory, or was
    counted twice, must not cancel an in-place write to a kept slot's rows (found by a review: each
    case below kept slot 1's stale copy)."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    n_in, n_out = 8, 4

    def new_slice() -> LoRASliceWeights:
        w = LoRASliceWeights.allocate(n_in, n_out, 2, 16, torch.bfloat16, "cpu")
        for slot, start in ((0, 0), (1, 8)):
            w.write_slot(slot, start, torch.randn(4, n_in, generator=gen).bfloat16(), torch.randn(n_out, 4, generator=gen).bfloat16(), 1.0)
        return w

    def rewrite_slot0(w: LoRASliceWeights) -> None:
        w.write_slot(0, 0, torch.randn(4, n_in, generator=gen).bfloat16(), torch.randn(n_out, 4, generator=gen).bfloat16(), 1.0)

    meta = LoRABatchMeta.build([0, 1], "cpu", decode_only=True)
    w = new_slice()
    weights = [w, w] if case == "slice_twice" else [w]
    offsets = [0, n_out][: len(weights)]
    apply_row_ranges(torch.randn(2, n_in, generator=gen), torch.zeros(2, n_out * len(weights)), weights, meta, offsets)
    if case == "slice_twice":
        rewrite_slot0(w)
    elif case == "swapped_out":
        original = w.a_rows
        w.a_rows = original.clone()
        rewrite_slot0(w)
        w.a_rows = original
    elif case == "copy_with_own_buffers":
        twin = copy.copy(w)
        twin.a_rows, twin.b_rows = w.a_rows.clone(), w.b_rows.clone()
        twin.host_start, twin.host_rank, twin.host_scale = list(w.host_start), list(w.host_rank), list(w.host_scale)
        rewrite_slot0(twin)
    w.a_rows[8:12].mul_(-3)  # slot 1's rows, in place, not by write_slot
    if case != "swapped_out":  # there A's count is the one the write into the swapped-out clone would cancel
        w.b_rows[8:12].mul_(-3)
    x = torch.randn(2, n_in, generator=gen)
    cached, fresh = torch.zeros(2, n_out * len(weights)), torch.zeros(2, n_out * len(weights))
    apply_row_ranges(x, cached, weights, meta, offsets)
    apply_row_ranges(x, fresh, [dataclasses.replace(each, view_cache={}) for each in weights], meta, offsets)
    assert torch.equal(cached, fresh)


def test_fused_apply_with_no_targeted_slot_adds_nothing_then_sees_a_new_slot():
    """Rows with adapters, but no slot holds weights for these slices (e.g. an MLP no adapter
    targets): ``apply_lora`` returns before the ops and ``y`` is untouched; once a slot is written,
    the very next call adds exactly its update (float64 reference), and clearing it stops it."""
    gen = torch.Generator().manual_seed(5)
    weights = LoRASliceWeights.allocate_projection(IN, list(OUTS), 4, 64, torch.float32, "cpu", interleaved=True)
    slots = [1, 1, -1, 2]
    meta = LoRABatchMeta.build(slots, "cpu", decode_only=True)
    offsets = [0, OUTS[0], OUTS[0] + OUTS[1]]
    x, work = torch.randn(len(slots), IN, generator=gen), torch.zeros(len(OUTS), len(slots), MAX_RANK)
    y = torch.randn(len(slots), sum(OUTS), generator=gen)
    before = y.clone()
    apply_lora(ReferenceLoRAOps(), x, y, weights, meta, offsets, work)
    assert torch.equal(y, before)
    a, b = torch.randn(4, IN, generator=gen), torch.randn(OUTS[1], 4, generator=gen)
    weights[1].write_slot(1, 0, a, b, 0.5)
    apply_lora(ReferenceLoRAOps(), x, y, weights, meta, offsets, work)
    expected = before.double()
    expected[:2, OUTS[0] : OUTS[0] + OUTS[1]] += 0.5 * (x[:2].double() @ a.double().t()) @ b.double().t()
    assert (y.double() - expected).abs().max() < 1e-4
    weights[1].clear_slot(1)
    again = y.clone()
    apply_lora(ReferenceLoRAOps(), x, y, weights, meta, offsets, work)
    assert torch.equal(y, again)


def test_row_ranges_batched_expand_matches_float64():
    """q/k/v-like slices of one width, A and B interleaved: slots whose slices share one rank and
    one scale take the one-``baddbmm_`` expand; slots with unequal ranks, an untargeted slice or
    unequal scales take the per-slice expands; both match a float64 loop, rows without an
    adapter stay untouched, and swapping a B buffer out of the group falls back at once."""
    gen = torch.Generator().manual_seed(zlib.crc32(b"batched-expand"))
    outs, slots_n = (24, 24, 24), 5
    # per slot: (rank per slice, scale per slice); slot 0 and 3 qualify for the batched expand
    plan = [((8, 8, 8), (0.5, 0.5, 0.5)), ((4, 8, 8), (1.0, 1.0, 1.0)), ((8, 0, 8), (2.0, 2.0, 2.0)),
            ((16, 16, 16), (1.5, 1.5, 1.5)), ((8, 8, 8), (1.0, 0.25, 1.0))]  # fmt: skip
    weights = LoRASliceWeights.allocate_projection(IN, list(outs), slots_n, 64, torch.float32, "cpu", interleaved=True)
    assert weights[0].b_group is not None
    for w in weights:  # finite garbage in rows no slot owns, and past a slice's rank
        w.a_rows.copy_(torch.randn(w.a_rows.shape, generator=gen) * 100)
        w.b_rows.copy_(torch.randn(w.b_rows.shape, generator=gen) * 100)
    host, start = {}, 0
    for s, (ranks, scales) in enumerate(plan):
        for i, (r, scale) in enumerate(zip(ranks, scales)):
            if r == 0:
                weights[i].clear_slot(s)
                continue
            a, b = torch.randn(r, IN, generator=gen), torch.randn(outs[i], r, generator=gen)
            weights[i].write_slot(s, start, a, b, scale)
            host[(s, i)] = (a.double(), b.double(), scale)
        start += max(ranks)
    slots = [-1, 0, 0, 1, 2, 2, 3, 3, 3, 4, -1]
    meta = LoRABatchMeta.build(slots, "cpu", decode_only=True)
    offsets = [0, outs[0], outs[0] + outs[1]]
    x = torch.randn(len(slots), IN, generator=gen)

    def check() -> None:
        y = torch.randn(len(slots), sum(outs), generator=gen)
        expected = y.double().clone()
        for t, s in enumerate(slots):
            for i in range(len(outs)):
                if s >= 0 and (s, i) in host:
                    a, b, scale = host[(s, i)]
                    expected[t, offsets[i] : offsets[i] + outs[i]] += scale * (x[t].double() @ a.t()) @ b.t()
        before = y.clone()
        apply_lora(ReferenceLoRAOps(), x, y, weights, meta, offsets, torch.zeros(3, len(slots), MAX_RANK))
        assert ((y.double() - expected).abs().max() / expected.abs().max()) < 1e-5
        assert torch.equal(y[[0, -1]], before[[0, -1]])

    check()
    views = SlotViews.cache_for(weights)
    assert {s for s, v in views.items() if v.b_block is not None} == {0, 3}  # the batched path did run
    weights[2].b_rows = weights[2].b_rows.clone()  # B of slice 2 leaves the group
    check()
    assert all(v.b_block is None for v in SlotViews.cache_for(weights).values())


class _RecordingOps:
    """LoRA ops that record every call (shrink, expand, fused apply) and do nothing else."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def shrink(self, x, weights, meta, out) -> None:  # type: ignore[no-untyped-def]
        self.calls.append("shrink")

    def expand(self, h, weights, meta, y, slice_offsets) -> None:  # type: ignore[no-untyped-def]
        self.calls.append("expand")


def test_apply_lora_calls_no_op_for_a_projection_no_resident_adapter_targets():
    """Adapters on q/k/v/o only leave gate/up and down with rank 0 in every slot: the backend's
    launchers (table lookup, checks) are not reached there; once a slot targets the projection, they are."""
    weights = [LoRASliceWeights.allocate(IN, out, SLOTS, 64, torch.float32, "cpu") for out in OUTS[:2]]
    meta = LoRABatchMeta.build([0, -1, 3, 0], "cpu", decode_only=True)
    x, y = torch.randn(4, IN), torch.randn(4, sum(OUTS[:2]))
    before = y.clone()
    ops = _RecordingOps()
    apply_lora(ops, x, y, weights, meta, [0, OUTS[0]], torch.zeros(2, 4, MAX_RANK))
    assert ops.calls == [] and torch.equal(y, before)
    weights[1].write_slot(3, 0, torch.randn(4, IN), torch.randn(OUTS[1], 4), 1.0)  # one slot, one slice
    apply_lora(ops, x, y, weights, meta, [0, OUTS[0]], torch.zeros(2, 4, MAX_RANK))
    assert ops.calls == ["shrink", "expand"]


@pytest.mark.parametrize("decode_only", [False, True])
def test_the_reference_refuses_arguments_it_cannot_honour(decode_only):
    """The rules every backend shares (runtime/lora/op_arguments.py): a batch description for fewer
    rows than x gave the rest no LoRA, slot 7 of 4 was a bare IndexError, offset True was column 1,
    2.5 a bare TypeError, and a broadcast y summed every row's update into one row."""
    gen = torch.Generator().manual_seed(23)
    w = LoRASliceWeights.allocate(16, 8, 4, 16, torch.float32, "cpu")
    for s in range(4):
        w.write_slot(s, 4 * s, torch.randn(4, 16, generator=gen), torch.randn(8, 4, generator=gen), 0.5)
    x, ws = torch.randn(8, 16, generator=gen), torch.zeros(1, 8, 4)
    assert_bad_arguments_refused(lambda x_, y_, meta_, offsets, ws_: ReferenceLoRAOps().apply(x_, y_, [w], meta_, offsets, ws_),
                                 x, torch.zeros(8, 12), ws, decode_only)  # fmt: skip
    assert_good_arguments_applied(lambda x_, y_, meta_, offsets, ws_: ReferenceLoRAOps().apply(x_, y_, [w], meta_, offsets, ws_),
                                  [w], x, torch.randn(8, 12, generator=gen), ws, decode_only, 4, 1e-5)  # fmt: skip
