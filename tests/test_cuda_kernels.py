"""Triton LoRA kernels (backends/cuda) against the reference ops and a float64 oracle.

``interpreter`` tests run the real kernels on CPU tensors under TRITON_INTERPRET=1
(``make test`` sets it); shapes are tiny and launches few (~40 ms each). ``cuda``
tests run the same checks at realistic shapes on a GPU, plus CUDA-graph capture and
a whole-model greedy comparison with the cpu backend.

Every case mixes ranks (including ones that are not multiples of 16 and one larger
than a rank tile), rows with no adapter, a slot whose rows are scattered in the
batch, slices where a slot has rank 0, and poisoned buffers: ``out``/``h`` entries
that must not be written or read are NaN, weight rows outside any slot are NaN, and
``y`` entries that must stay untouched are compared bit for bit.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Sequence

import pytest
import torch

from backends.reference import ReferenceLoRAOps
from runtime.backend_api import apply_lora
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.slice_weights import LoRASliceWeights

triton = pytest.importorskip("triton")

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
interpreter = pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1 set before triton kernels are defined")
on_gpu = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA GPU and no TRITON_INTERPRET")

# slot -> rank per slice. Slot 1 skips slice 1 and slot 4 skips slice 0 (rank 0);
# 80 > the 64-wide rank tile, 24 and 8 are not multiples of 16.
SMALL_RANKS = (
    {0: 16, 1: 80, 2: 48, 3: 24, 4: 0},
    {0: 16, 1: 0, 2: 8, 3: 24, 4: 32},
    {0: 32, 1: 16, 2: 48, 3: 8, 4: 16},
)
# Slot 2's rows are scattered; -1 rows have no adapter; slot 5 exists but is unused.
SMALL_SLOTS = (2, -1, 0, 3, 2, 1, -1, 4, 2, 3, 1, 2, 0, -1)
MAX_SLOTS = 6


@dataclass(frozen=True)
class Problem:
    """Weights of several slices, the batch mapping and the float64 copies for the oracle."""

    weights: list[LoRASliceWeights]
    ranks: Sequence[dict[int, int]]
    offsets: list[int]
    y_width: int


def make_slices(in_features: int, outs: Sequence[int], ranks: Sequence[dict[int, int]], dtype: torch.dtype, device: str, seed: int) -> list[LoRASliceWeights]:
    """Slices with random A/B at each slot's own rank, rows placed with gaps and in
    shuffled slot order; every row no slot owns is NaN (a read past a rank shows)."""
    gen = torch.Generator().manual_seed(seed)
    slices = []
    for out_features, slot_ranks in zip(outs, ranks):
        capacity = sum(slot_ranks.values()) + 3 * len(slot_ranks) + 5
        w = LoRASliceWeights.allocate(in_features, out_features, MAX_SLOTS, capacity, dtype, device)
        w.a_rows.fill_(float("nan"))
        w.b_rows.fill_(float("nan"))
        row = 3
        for slot in sorted(slot_ranks, reverse=True):
            r = slot_ranks[slot]
            if r == 0:
                continue
            a = torch.randn(r, in_features, generator=gen) / in_features**0.5
            b = torch.randn(out_features, r, generator=gen) / r**0.5
            scale = float(torch.empty(1).uniform_(0.5, 2.0, generator=gen))
            w.write_slot(slot, row, a.to(dtype), b.to(dtype), scale)
            row += r + 3
        slices.append(w)
    return slices


def finite(weights: Sequence[LoRASliceWeights]) -> list[LoRASliceWeights]:
    """Copies with the NaN poison rows zeroed: the reference per-token path gathers
    rank-padded rows and masks by multiplying, so it needs finite unused rows."""
    return [dataclasses.replace(w, a_rows=w.a_rows.nan_to_num(0.0), b_rows=w.b_rows.nan_to_num(0.0)) for w in weights]


def oracle_shrink(x: torch.Tensor, w: LoRASliceWeights, slot: int) -> torch.Tensor:
    r, s = w.host_rank[slot], w.host_start[slot]
    return x.double() @ w.a_rows[s : s + r].double().t()


def oracle_delta(h_row: torch.Tensor, w: LoRASliceWeights, slot: int) -> torch.Tensor:
    r, s = w.host_rank[slot], w.host_start[slot]
    return w.host_scale[slot] * (h_row[:r].double() @ w.b_rows[s : s + r].double())


def tolerance(dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, float]:
    """Expand tolerances vs float64. y is rounded once to its dtype (half an ulp); on a GPU
    the fp16/bf16 expand also rounds h to that dtype for the tensor-core dot, an extra
    ~1 ulp-of-h error summed over up to 128 ranks (so the GPU bounds are wider)."""
    if torch.device(device).type == "cuda":
        return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=5e-3, atol=5e-3), torch.bfloat16: dict(rtol=2e-2, atol=4e-2)}[dtype]
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}[dtype]


def check_shrink_result(x: torch.Tensor, weights: Sequence[LoRASliceWeights], slots: Sequence[int], out: torch.Tensor) -> None:
    """Adapter rows hold x @ A^T up to their rank and NaN past it; -1 rows are all NaN."""
    for i, w in enumerate(weights):
        for t, slot in enumerate(slots):
            r = w.host_rank[slot] if slot >= 0 else 0
            if r:
                expect = oracle_shrink(x[t : t + 1], w, slot)[0]
                torch.testing.assert_close(out[i, t, :r].double(), expect, rtol=1e-4, atol=1e-4, msg=f"slice {i} row {t} slot {slot}")
            assert torch.isnan(out[i, t, r:]).all(), f"slice {i} row {t}: wrote past rank {r}"


def check_expand_result(h: torch.Tensor, weights: Sequence[LoRASliceWeights], slots: Sequence[int], offsets: Sequence[int], y0: torch.Tensor, y: torch.Tensor) -> None:
    """Adapter rows gain scale * h @ B^T in each slice; every other entry is bit-identical."""
    expect = y0.double().clone()
    touched = torch.zeros_like(y0, dtype=torch.bool)
    for i, (w, off) in enumerate(zip(weights, offsets)):
        for t, slot in enumerate(slots):
            if slot >= 0 and w.host_rank[slot]:
                cols = slice(off, off + w.out_features)
                expect[t, cols] += oracle_delta(h[i, t], w, slot)
                touched[t, cols] = True
    assert torch.equal(y[~touched], y0[~touched]), "expand wrote outside the adapter rows' slices"
    torch.testing.assert_close(y.double()[touched], expect[touched], **tolerance(y.dtype, y.device))


def poisoned_h(weights: Sequence[LoRASliceWeights], slots: Sequence[int], width: int, device: str, seed: int) -> torch.Tensor:
    """h with random values inside each row's rank and NaN everywhere a kernel must not read."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.full((len(weights), len(slots), width), float("nan"), device=device)
    for i, w in enumerate(weights):
        for t, slot in enumerate(slots):
            r = w.host_rank[slot] if slot >= 0 else 0
            h[i, t, :r] = torch.randn(r, generator=gen).to(device)
    return h


def run_case(path: str, dtype: torch.dtype, device: str, in_features: int, outs: Sequence[int], ranks: Sequence[dict[int, int]], slots: Sequence[int], seed: int) -> None:
    from backends.cuda.bgmv_expand import bgmv_expand
    from backends.cuda.bgmv_shrink import bgmv_shrink
    from backends.cuda.sgmv_expand import sgmv_expand
    from backends.cuda.sgmv_shrink import sgmv_shrink

    shrink, expand = {"segment": (sgmv_shrink, sgmv_expand), "per_token": (bgmv_shrink, bgmv_expand)}[path]
    weights = make_slices(in_features, outs, ranks, dtype, device, seed)
    meta = LoRABatchMeta.build(slots, device, decode_only=(path == "per_token"))
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(len(slots), in_features, generator=gen).to(dtype).to(device)
    width = max(w.max_rank for w in weights)

    out = torch.full((len(weights), len(slots), width), float("nan"), device=device)
    shrink(x, weights, meta, out)
    check_shrink_result(x, weights, slots, out)

    # Slices sit at offsets with gaps between them; the gaps must stay untouched.
    offsets, col = [], 3
    for w in weights:
        offsets.append(col)
        col += w.out_features + 5
    h = poisoned_h(weights, slots, width, device, seed + 2)
    y0 = torch.randn(len(slots), col, generator=gen).to(dtype).to(device)
    y = y0.clone()
    expand(h, weights, meta, y, offsets)
    check_expand_result(h, weights, slots, offsets, y0, y)

    # The reference ops agree (they are the definition the cpu backend serves with).
    if device == "cpu":
        ref_y = y0.clone()
        ReferenceLoRAOps().expand(torch.nan_to_num(h), finite(weights), meta, ref_y, offsets)
        torch.testing.assert_close(y.float(), ref_y.float(), **tolerance(dtype))


# ---------------------------------------------------------------- interpreter (CI)

@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["segment", "per_token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_kernels_match_oracle_interpreted(path: str, dtype: torch.dtype) -> None:
    run_case(path, dtype, "cpu", in_features=40, outs=(24, 40, 8), ranks=SMALL_RANKS, slots=SMALL_SLOTS, seed=7)


@interpreter
@pytest.mark.interpreter
def test_largest_segment_tiles_interpreted() -> None:
    """Segments of 40 and 30 rows, then of 150 (three 64-row tiles, the last one ragged) and 20,
    and a 130-wide slice: the 64 x 128 expand tile, launched with 8 warps (``expand_warps``),
    one program per tile, and ragged edges in every dimension."""
    from backends.cuda.kernel_config import expand_warps, segment_tiles, shrink_warps

    tiles = segment_tiles(64, 16, 32, 130)
    assert (tiles.block_m, tiles.block_n, expand_warps(tiles)) == (64, 128, 8)
    assert expand_warps(segment_tiles(16, 16, 32, 130)) == 4
    assert shrink_warps(segment_tiles(64, 64, 32, 130)) == 8 and shrink_warps(tiles) == 4  # rank 16 here
    run_case("segment", torch.float32, "cpu", in_features=32, outs=(130,), ranks=[{0: 16, 1: 8}], slots=[0] * 40 + [1] * 30 + [-1], seed=3)
    run_case("segment", torch.float32, "cpu", in_features=32, outs=(130,), ranks=[{0: 16, 1: 8}], slots=[1] * 20 + [-1] + [0] * 150, seed=4)


@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["per_token", "segment"])
def test_tiled_k_and_columns_interpreted(path: str) -> None:
    """Past one tile in K and in columns: in 160 and a 144-wide slice at rank 64 give the per-token
    kernels 64 x 128 tiles (``token_tiles``: two K tiles in shrink, two column blocks in expand) and
    the segment kernels three 64-wide K tiles and two 128-column blocks; beside it a 24-wide slice,
    whose second column block returns at once, and a slot of rank 0 in each slice."""
    from backends.cuda.kernel_config import segment_tiles, token_tiles

    assert (token_tiles(64, 160, 144).block_k, token_tiles(64, 160, 144).block_n) == (128, 128)
    assert (segment_tiles(2, 64, 160, 144).block_k, segment_tiles(2, 64, 160, 144).block_n) == (64, 128)
    ranks = [{0: 64, 1: 8, 2: 0}, {0: 0, 1: 8, 2: 40}]
    run_case(path, torch.float32, "cpu", in_features=160, outs=(144, 24), ranks=ranks, slots=[0, -1, 2, 1, 0, 2], seed=11)


@interpreter
@pytest.mark.interpreter
def test_backend_ops_pick_path_and_reuse_tables_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaLoRAOps through apply_lora equals the reference ops on the same inputs, for a
    decode step (per-token kernels) and a prefill step (segment kernels), and launches those."""
    import importlib

    from backends.cuda.backend import CudaLoRAOps

    launched: list[str] = []
    for name in ("bgmv_shrink", "bgmv_expand", "sgmv_shrink", "sgmv_expand"):
        module = importlib.import_module(f"backends.cuda.{name}")
        launcher = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _name=name, _launch=launcher, **k: (launched.append(_name), _launch(*a, **k))[1])
    ops, ref = CudaLoRAOps(), ReferenceLoRAOps()
    weights = finite(make_slices(32, (16, 32), SMALL_RANKS[1:], torch.float32, "cpu", seed=3))
    x = torch.randn(len(SMALL_SLOTS), 32)
    for decode_only in (True, False):
        meta = LoRABatchMeta.build(SMALL_SLOTS, "cpu", decode_only=decode_only)
        y0 = torch.randn(len(SMALL_SLOTS), 48)
        got, want = y0.clone(), y0.clone()
        apply_lora(ops, x, got, weights, meta, [0, 16], torch.zeros(2, len(SMALL_SLOTS), 64))
        apply_lora(ref, x, want, weights, meta, [0, 16], torch.zeros(2, len(SMALL_SLOTS), 64))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        kind = "bgmv" if decode_only else "sgmv"
        assert launched == [f"{kind}_shrink", f"{kind}_expand"], (decode_only, launched)
        launched.clear()
    assert len(ops.tables) == 2  # one shrink table and one expand table, reused across steps


@interpreter
@pytest.mark.interpreter
def test_no_adapter_batch_writes_nothing_interpreted() -> None:
    from backends.cuda.backend import CudaLoRAOps

    weights = make_slices(32, (16,), SMALL_RANKS[:1], torch.float16, "cpu", seed=5)
    for decode_only in (True, False):
        meta = LoRABatchMeta.build([-1, -1, -1], "cpu", decode_only=decode_only)
        out = torch.full((1, 3, 80), float("nan"))
        CudaLoRAOps().shrink(torch.randn(3, 32).half(), weights, meta, out)
        assert torch.isnan(out).all()
        y0 = torch.randn(3, 16).half()
        y = y0.clone()
        CudaLoRAOps().expand(out, weights, meta, y, [0])
        assert torch.equal(y, y0)


@interpreter
@pytest.mark.interpreter
def test_whole_model_greedy_matches_cpu_backend_interpreted(tiny_llama_dir, tiny_adapters) -> None:
    """The kernels inside the real model (slice groups, offsets, workspace from
    ModelRunner): greedy tokens of a mixed batch equal the cpu backend's in fp32."""
    import runtime.model_runner as runner_mod
    from backends import get_backend

    cpu = greedy_tokens(runner_mod, tiny_llama_dir, tiny_adapters, get_backend("cpu"), "float32", new_tokens=3)
    kernels = greedy_tokens(runner_mod, tiny_llama_dir, tiny_adapters, InterpretedCudaBackend(), "float32", new_tokens=3)
    assert kernels == cpu


@interpreter
@pytest.mark.interpreter
def test_offsets_past_2_31_elements_interpreted() -> None:
    """Every element offset the kernels form (row * stride of x, y, out and h; weight row * width
    of A and B) is int64: Triton does int32 arithmetic on int32 operands, and a product past
    2^31 - 1 wraps. A pool of 4096 slots x rank 64 x in 8192 reaches it in A, ~1200 slots x
    rank 64 in a B of out 28672; activations need T x width past it (75k rows of 28672).
    Here row 2 of x/y/out/h and the slot's first A/B row sit 2^31 + 128 and 2^31 elements
    from their tensors' starts: views into one 8 GiB block of address space, of which the
    kernels and the test touch a few pages. The interpreter wraps int32 as the GPU does, so
    an offset left in int32 reads or writes 4-8 GiB before the block (a crash here)."""
    from backends.cuda.bgmv_expand import bgmv_expand
    from backends.cuda.bgmv_shrink import bgmv_shrink
    from backends.cuda.sgmv_expand import sgmv_expand
    from backends.cuda.sgmv_shrink import sgmv_shrink

    try:
        mem = torch.empty((8 << 30) + (1 << 20), dtype=torch.uint8)  # address space; untouched pages cost nothing
    except RuntimeError:
        pytest.skip("cannot reserve 8 GiB of address space")
    f16, f32 = mem.view(torch.float16), mem.view(torch.float32)
    width, rank = 16, 8  # in = out = 16
    start = 1 << 27  # the slot's first weight row: start * width = 2^31
    stride = (1 << 30) + 64  # row 2 of x, y (fp16) and out/h (fp32) at 2^31 + 128 elements
    w = LoRASliceWeights.allocate(width, width, 1, 0, torch.float16, "cpu")
    w.a_rows = f16[1 << 16 :][: (start + rank) * width].view(start + rank, width)
    w.b_rows = f16[1 << 17 :][: (start + rank) * width].view(start + rank, width)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(rank, width, generator=gen).half(), torch.randn(width, rank, generator=gen).half()
    w.write_slot(0, start, a, b, 0.5)
    x = f16.as_strided((3, width), (stride, 1), 1 << 10)
    y = f16.as_strided((3, width), (stride, 1), 1 << 11)
    out = f32.as_strided((1, 3, rank), (rank, stride, 1), 0)
    for t in range(3):
        x[t] = torch.randn(width, generator=gen).half()
    slots = [0, -1, 0]
    expect_h = x.double() @ a.double().t()
    for path, shrink, expand in (("segment", sgmv_shrink, sgmv_expand), ("per_token", bgmv_shrink, bgmv_expand)):
        meta = LoRABatchMeta.build(slots, "cpu", decode_only=path == "per_token")
        out.fill_(float("nan"))
        y.fill_(1.0)
        shrink(x, [w], meta, out)
        for t in (0, 2):
            torch.testing.assert_close(out[0, t].double(), expect_h[t], rtol=1e-3, atol=1e-3, msg=f"{path} shrink row {t}")
        assert torch.isnan(out[0, 1]).all(), f"{path} shrink wrote the no-adapter row"
        h = out.nan_to_num(0.0).contiguous()
        out.copy_(h)  # expand reads h from out's far rows too
        expand(out, [w], meta, y, [0])
        for t in (0, 2):
            torch.testing.assert_close(y[t].double(), 1.0 + 0.5 * h[0, t].double() @ b.double().t(), rtol=2e-3, atol=2e-3, msg=f"{path} expand row {t}")
        assert torch.equal(y[1], torch.ones(width, dtype=torch.float16)), f"{path} expand wrote the no-adapter row"


def check_fp16_expand_past_fp16_max(device: str) -> None:
    """fp16 sgmv_expand rounds h to fp16 for its tensor-core dot; an |h| above 65504 became inf
    there although scale * h @ B^T fits fp16 (the float64 oracle is finite). Rank 80 is two rank
    tiles, each scaled on its own: row 0 is large in the second only, row 1 is ordinary (scaled
    with its tile), row 3 is large in the first tile, row 4 around 10^6 everywhere; row 2 has no
    adapter. Row 5's h holds an inf in each rank tile (an fp16 activation that overflowed): it
    must stay in row 5 (an inf tile max made the scale inf and the whole tile, the other
    requests' rows with it, NaN). y starts small (1e-3) so that row 1's own LoRA term (~1e-3)
    is far above the bound: its loss would show."""
    from backends.cuda.sgmv_expand import sgmv_expand

    rank, out_features = 80, 24
    gen = torch.Generator().manual_seed(5)
    w = LoRASliceWeights.allocate(16, out_features, 2, rank, torch.float16, device)
    b = ((torch.rand(out_features, rank, generator=gen) - 0.5) * 2e-4).half()
    w.write_slot(1, 0, torch.zeros(rank, 16).half(), b, 0.75)
    slots = [1, 1, -1, 1, 1, 1]
    h = torch.randn(1, len(slots), rank, generator=gen)
    h[0, 0, 64:] *= 1.5e5
    h[0, 2, :] = float("nan")  # the -1 row: never read
    h[0, 3, :64] *= 9e4
    h[0, 4] *= 1e6
    h[0, 5, 3] = h[0, 5, 70] = float("inf")
    y0 = (torch.randn(len(slots), out_features, generator=gen) * 1e-3).half()
    y = y0.to(device, copy=True)
    sgmv_expand(h.to(device), [w], LoRABatchMeta.build(slots, device), y, [0])
    y = y.cpu()
    rows = [0, 1, 3, 4]
    hd, bd = h[0, rows].double(), b.double()
    want = y0[rows].double() + 0.75 * hd @ bd.t()
    assert want.abs().max() < 65504 and hd.abs().max() > 65504
    # h rounded to fp16 once (2^-11 relative) inside the dot, y rounded once at the end (2^-11),
    # fp32 sums: twice those bounds (the interpreter reaches 0.34 of the single ones, with y starting at 1e-3).
    bound = 2**-10 * (0.75 * hd.abs() @ bd.abs().t() + want.abs()) + 1e-6
    err = (y[rows].double() - want).abs()
    assert (err <= bound).all(), f"error / bound up to {(err / bound).max().item()}, y finite: {torch.isfinite(y).all().item()}"
    assert torch.equal(y[2], y0[2])


@interpreter
@pytest.mark.interpreter
def test_fp16_segment_expand_survives_h_above_fp16_max_interpreted() -> None:
    check_fp16_expand_past_fp16_max("cpu")


def test_bf16_dot_is_upcast_when_interpreting() -> None:
    from backends.cuda.kernel_config import dot_in_fp32

    assert dot_in_fp32(torch.float32)
    assert not dot_in_fp32(torch.float16)
    assert dot_in_fp32(torch.bfloat16) == INTERPRETING


# ---------------------------------------------------------------- argument checks (no launches)

def _small() -> tuple[list[LoRASliceWeights], LoRABatchMeta]:
    return make_slices(32, (16, 24), SMALL_RANKS[1:], torch.float16, "cpu", seed=1), LoRABatchMeta.build([0, -1, 2], "cpu")


def test_launchers_reject_bad_arguments() -> None:
    from backends.cuda.bgmv_expand import bgmv_expand
    from backends.cuda.sgmv_shrink import sgmv_shrink

    weights, meta = _small()
    x = torch.randn(3, 32).half()
    with pytest.raises(ValueError, match=r"sgmv_shrink: x is torch.float32 on cpu, the weights are torch.float16 on cpu"):
        sgmv_shrink(x.float(), weights, meta, torch.zeros(2, 3, 64))
    with pytest.raises(ValueError, match=r"sgmv_shrink: x has 16 features, the weights expect 32"):
        sgmv_shrink(x[:, :16], weights, meta, torch.zeros(2, 3, 64))
    with pytest.raises(ValueError, match=r"sgmv_shrink: out must be \[>= 2 slices, T=3, >= max rank 48\]"):
        sgmv_shrink(x, weights, meta, torch.zeros(2, 3, 40))
    with pytest.raises(ValueError, match=r"sgmv_shrink: out must be a 3-D float32"):
        sgmv_shrink(x, weights, meta, torch.zeros(2, 3, 64).half())
    with pytest.raises(ValueError, match=r"sgmv_shrink: meta has 4 token rows, the activations have 3"):
        sgmv_shrink(x, weights, LoRABatchMeta.build([0, 1, 2, 3], "cpu"), torch.zeros(2, 3, 64))
    with pytest.raises(ValueError, match=r"sgmv_shrink: meta uses slot 9, the weights have only 6 slots"):
        sgmv_shrink(x, weights, LoRABatchMeta.build([9, 0, 0], "cpu"), torch.zeros(2, 3, 64))
    h = torch.zeros(2, 3, 64)
    with pytest.raises(ValueError, match=r"bgmv_expand: the slices at offsets \(0, 20\) need 44 columns, y has 40"):
        bgmv_expand(h, weights, meta, torch.zeros(3, 40).half(), [0, 20])
    with pytest.raises(ValueError, match=r"bgmv_expand: 2 slices but 1 slice_offsets"):
        bgmv_expand(h, weights, meta, torch.zeros(3, 40).half(), [0])
    with pytest.raises(ValueError, match=r"bgmv_expand: h must be a 3-D float32"):
        bgmv_expand(h.half(), weights, meta, torch.zeros(3, 40).half(), [0, 16])
    with pytest.raises(ValueError, match=r"bgmv_expand: slice_offsets must be integers >= 0"):
        bgmv_expand(h, weights, meta, torch.zeros(3, 40).half(), [0, -1])
    with pytest.raises(ValueError, match=r"bgmv_expand: slice_offsets must be integers >= 0, got \(0, 16.5\)"):  # was truncated to 16
        bgmv_expand(h, weights, meta, torch.zeros(3, 40).half(), [0, 16.5])
    # Outputs whose rows share memory (a broadcast row): every program would add into one row (the
    # per-token path summed all rows' deltas there, the segment path kept the last), a race on a GPU.
    with pytest.raises(ValueError, match=r"bgmv_expand: y's rows share memory \(shape \(3, 40\), strides \(0, 1\)\)"):
        bgmv_expand(h, weights, meta, torch.zeros(1, 40).half().expand(3, 40), [0, 16])
    with pytest.raises(ValueError, match=r"sgmv_shrink: out's elements share memory"):
        sgmv_shrink(x, weights, meta, torch.zeros(2, 1, 64).expand(2, 3, 64))
    # Overlapping columns: the expand kernels' load-add-store would race on a GPU (the
    # interpreter runs programs one by one, so it would not show there). Shrink ignores offsets.
    from backends.cuda.sgmv_expand import sgmv_expand
    for expand in (bgmv_expand, sgmv_expand):
        with pytest.raises(ValueError, match=rf"{expand.__name__}: the slices' columns overlap in y \(offsets \(0, 8\)\)"):
            expand(h, weights, meta, torch.zeros(3, 40).half(), [0, 8])
    mixed = [weights[0], dataclasses.replace(weights[1], a_rows=weights[1].a_rows.float())]
    with pytest.raises(ValueError, match=r"sgmv_shrink: weights\[1\].a_rows is torch.float32, weights\[0\].a_rows is torch.float16"):
        sgmv_shrink(x, mixed, meta, torch.zeros(2, 3, 64))
    strided = [dataclasses.replace(weights[0], b_rows=weights[0].b_rows.t().contiguous().t())]
    with pytest.raises(ValueError, match=r"bgmv_expand: weights\[0\].b_rows must be a contiguous 2-D tensor"):
        bgmv_expand(h, strided, meta, torch.zeros(3, 40).half(), [0])


def test_segment_launchers_check_seg_tiles_device_and_dtype() -> None:
    """``seg_tiles`` is the segment kernels' program map (read as int32 from the weights'
    device), checked like the other index arrays; it was not, so a map on another device
    reached the launch (a foreign pointer on a GPU). Torch's "meta" device stands in for
    the other device: no launch happens."""
    from backends.cuda.sgmv_expand import sgmv_expand
    from backends.cuda.sgmv_shrink import sgmv_shrink

    weights, meta = _small()
    x, h, y = torch.randn(3, 32).half(), torch.zeros(2, 3, 64), torch.zeros(3, 40).half()
    elsewhere = dataclasses.replace(meta, seg_tiles=meta.seg_tiles.to("meta"))
    wide = dataclasses.replace(meta, seg_tiles=meta.seg_tiles.long())
    with pytest.raises(ValueError, match=r"sgmv_shrink: meta.seg_tiles must be int32 on cpu, got torch.int32 on meta"):
        sgmv_shrink(x, weights, elsewhere, torch.zeros(2, 3, 64))
    with pytest.raises(ValueError, match=r"sgmv_expand: meta.seg_tiles must be int32 on cpu, got torch.int32 on meta"):
        sgmv_expand(h, weights, elsewhere, y, [0, 16])
    with pytest.raises(ValueError, match=r"sgmv_shrink: meta.seg_tiles must be int32 on cpu, got torch.int64 on cpu"):
        sgmv_shrink(x, weights, wide, torch.zeros(2, 3, 64))


def test_grid_axes_past_cuda_limits_are_refused() -> None:
    """CUDA caps grid axis 0 at 2^31 - 1 and axes 1 and 2 at 65535; Triton does not check, and the
    driver's refusal names no shape. The expand kernels put slices x column blocks on axis 1."""
    from backends.cuda.lora_checks import check_grid

    def axes() -> tuple[str, str]:
        return ("rows", "slices x column blocks")

    check_grid("op", (2**31 - 1, 65535), axes)  # at the limits
    with pytest.raises(ValueError, match=r"op: grid axis 1 would have 65536 programs \(slices x column blocks\), above CUDA's limit of 65535"):
        check_grid("op", (1, 65536), axes)
    with pytest.raises(ValueError, match=r"op: grid axis 0 would have 2147483648 programs \(rows\)"):
        check_grid("op", (2**31, 1), axes)


def test_expand_refuses_a_slice_too_wide_for_grid_axis_1() -> None:
    """A slice of 65535 x 128 + 1 columns at rank 64 needs 65536 column blocks of 128 on axis 1 in
    both expand kernels. Before, the launch went ahead (the driver refuses it, naming no shape).
    Tensors on torch's "meta" device: no memory, no launch."""
    from backends.cuda.bgmv_expand import bgmv_expand
    from backends.cuda.sgmv_expand import sgmv_expand

    out = 65535 * 128 + 1
    w = LoRASliceWeights.allocate(16, out, 1, 64, torch.float16, "meta")
    w.write_slot(0, 0, torch.empty(64, 16, dtype=torch.float16, device="meta"), torch.empty(out, 64, dtype=torch.float16, device="meta"), 1.0)
    h, y = torch.empty(1, 1, 64, device="meta"), torch.empty(1, out, dtype=torch.float16, device="meta")
    for expand, decode_only in ((bgmv_expand, True), (sgmv_expand, False)):
        meta = LoRABatchMeta.build([0], "meta", decode_only=decode_only)
        with pytest.raises(ValueError, match=rf"{expand.__name__}: grid axis 1 would have 65536 programs \(1 slice\(s\) x 65536 column blocks "
                                             rf"of 128; the widest slice is {out} columns wide\), above CUDA's limit of 65535"):
            expand(h, [w], meta, y, [0])


@interpreter
@pytest.mark.interpreter
def test_launchers_accept_a_column_window_and_a_permuted_workspace_interpreted() -> None:
    """Layouts the checks above must not refuse (these two launch, so they need the interpreter;
    the refusals above never reach a kernel and run anywhere)."""
    from backends.cuda.bgmv_expand import bgmv_expand
    from backends.cuda.sgmv_shrink import sgmv_shrink

    weights, meta = _small()
    wide = torch.zeros(3, 100).half()
    bgmv_expand(torch.zeros(2, 3, 64), weights, meta, wide[:, 10:50], [0, 16])  # a column window of a wider y: rows apart
    assert wide[:, :10].eq(0).all() and wide[:, 50:].eq(0).all()
    sgmv_shrink(torch.randn(3, 32).half(), weights, meta, torch.zeros(3, 2, 64).transpose(0, 1))  # a permuted workspace [S, T, R]


def test_slot_tables_of_unequal_lengths_are_refused() -> None:
    """The kernels read slot_start, slot_rank and slot_scale at any slot the meta uses, and the
    meta is checked against len(slot_rank): a shorter slot_start or slot_scale would be read past
    its end (another tensor's memory on a GPU). Refused when the slice table is built, no launch."""
    from backends.cuda.slice_table import SliceTable

    weights, _ = _small()
    for name in ("slot_start", "slot_scale"):
        short = [weights[0], dataclasses.replace(weights[1], **{name: getattr(weights[1], name)[:2].clone()})]
        with pytest.raises(ValueError, match=rf"sgmv_shrink: weights\[1\]: slot_start, slot_rank and slot_scale must have one entry per slot, "
                                             rf"got .*'{name}': 2"):
            SliceTable.build(short, [0, 0], op="sgmv_shrink")


def test_slice_table_is_reused_checked_and_rebuilt() -> None:
    from backends.cuda.bgmv_shrink import bgmv_shrink
    from backends.cuda.slice_table import SliceTable, SliceTableCache

    weights, meta = _small()
    cache = SliceTableCache(capacity=2)
    first = cache.get(weights, [0, 16])
    assert cache.get(weights, [0, 16]) is first
    assert first.table.tolist()[1][:7] == [
        weights[1].a_rows.data_ptr(), weights[1].b_rows.data_ptr(), weights[1].slot_start.data_ptr(),
        weights[1].slot_rank.data_ptr(), weights[1].slot_scale.data_ptr(), 24, 16,
    ]
    with pytest.raises(ValueError, match="offsets"):
        first.check("expand", weights, [0, 8])
    weights[0].a_rows = weights[0].a_rows.clone()  # reallocated: the old table is stale
    with pytest.raises(ValueError, match=r"bgmv_shrink: the slice table was built for other weights"):
        bgmv_shrink(torch.zeros(3, 32).half(), weights, meta, torch.zeros(2, 3, 64), SliceTable.build(list(reversed(weights)), [0, 0]))
    assert cache.get(weights, [0, 16]) is not first
    cache.get(weights, [0, 0])
    cache.get(weights[:1], [0])
    assert len(cache) == 2


def test_cuda_backend_reports_availability() -> None:
    from backends.cuda.backend import CudaBackend

    ok, reason = CudaBackend.availability()
    assert ok == torch.cuda.is_available()
    assert reason.startswith("cuda: ")
    if not ok:
        assert reason == "cuda: torch.cuda.is_available() is False"
        with pytest.raises(RuntimeError, match="cuda: torch.cuda.is_available"):
            CudaBackend()
    elif not INTERPRETING:  # Triton launches on the current device only: another index is refused
        other = (torch.cuda.current_device() + 1) % max(2, torch.cuda.device_count())
        with pytest.raises(ValueError, match="is not the current CUDA device"):
            CudaBackend(f"cuda:{other}")


@pytest.mark.parametrize("capability, refused", [((7, 0), True), ((7, 5), True), ((8, 0), False), ((9, 0), False)])
def test_bfloat16_is_refused_below_sm_80(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], refused: bool) -> None:
    """On a V100 or T4 a bf16 engine used to start and crash at its first forward (Triton: ".bf16
    requires sm_80"); the gate now refuses it up front, naming float16/float32. Runs without a GPU:
    the backend's device queries are stood in."""
    from types import SimpleNamespace

    from backends.cuda.backend import CudaBackend
    from runtime.capabilities import CapabilityError, Gate

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla Stand-in")
    backend = SimpleNamespace(device=torch.device("cuda:0"))
    backend.dtype_problem = lambda dtype: CudaBackend.dtype_problem(backend, dtype)
    for dtype in ("float32", "float16"):
        assert backend.dtype_problem(dtype) is None
    if refused:
        with pytest.raises(CapabilityError, match=rf"dtype bfloat16 is not supported on this device: Tesla Stand-in is sm_{capability[0]}{capability[1]}.*--dtype float16"):
            Gate("cuda").check_device_dtype(backend, "bfloat16")
    else:
        Gate("cuda").check_device_dtype(backend, "bfloat16")


# ---------------------------------------------------------------- real GPU

def _gpu_ranks(n_slots: int, seed: int, skip_every: int) -> dict[int, int]:
    gen = torch.Generator().manual_seed(seed)
    choices = (8, 16, 24, 32, 64, 96, 128)
    return {s: (0 if (s + seed) % skip_every == 0 else choices[int(torch.randint(len(choices), (1,), generator=gen))]) for s in range(n_slots)}


def _gpu_slots(rows: int, n_slots: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(v) for v in torch.randint(-1, n_slots, (rows,), generator=gen)]


@on_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 7, 64, 256])
@pytest.mark.parametrize("path", ["segment", "per_token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_kernels_match_oracle_on_gpu(rows: int, path: str, dtype: torch.dtype) -> None:
    """q/k/v-like slices at hidden 4096 (GQA widths), ranks 8..128 mixed, rank-0 slices."""
    ranks = [_gpu_ranks(MAX_SLOTS, seed, skip_every=7) for seed in (1, 2, 3)]
    run_case(path, dtype, "cuda", in_features=4096, outs=(4096, 1024, 1024), ranks=ranks, slots=_gpu_slots(rows, MAX_SLOTS, rows), seed=rows)


@on_gpu
@pytest.mark.cuda
def test_fp16_segment_expand_survives_h_above_fp16_max_on_gpu() -> None:
    """The compiled tensor-core path of the case above (not yet run on a GPU when written)."""
    check_fp16_expand_past_fp16_max("cuda")


@on_gpu
@pytest.mark.cuda
def test_cuda_backend_attention_keeps_sdpa_off_cudnn() -> None:
    """The backend's attention is CudaAttention (cuDNN's SDPA builds a plan per new shape)."""
    from backends import get_backend
    from backends.cuda.attention import CudaAttention

    assert isinstance(get_backend("cuda").attention, CudaAttention)


@on_gpu
@pytest.mark.cuda
def test_per_token_kernels_replay_in_cuda_graph() -> None:
    """Capture shrink+expand once, then replay with other slots written into the same
    meta tensors: the result follows the new slots (no host reads were baked in)."""
    from backends.cuda.backend import CudaLoRAOps

    ops, ref = CudaLoRAOps(), ReferenceLoRAOps()
    ranks = [_gpu_ranks(MAX_SLOTS, seed, skip_every=5) for seed in (4, 5)]
    weights = finite(make_slices(4096, (4096, 1024), ranks, torch.bfloat16, "cuda", seed=11))
    rows = 32
    meta = LoRABatchMeta.build(_gpu_slots(rows, MAX_SLOTS, 1), "cuda", decode_only=True)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(rows, 5120, device="cuda", dtype=torch.bfloat16)
    ws = torch.zeros(2, rows, 128, device="cuda")
    apply_lora(ops, x, y, weights, meta, [0, 4096], ws)  # warm-up: compile + tables
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_lora(ops, x, y, weights, meta, [0, 4096], ws)
    new_slots = _gpu_slots(rows, MAX_SLOTS, 2)
    meta.token_slots.copy_(torch.tensor(new_slots, dtype=torch.int32, device="cuda"))
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = torch.zeros_like(y)
    apply_lora(ref, x, want, weights, LoRABatchMeta.build(new_slots, "cuda", decode_only=True), [0, 4096], torch.zeros_like(ws))
    torch.testing.assert_close(y.float(), want.float(), **tolerance(torch.bfloat16, "cuda"))


class InterpretedCudaBackend:
    """The cuda backend's ops on CPU tensors, for running the Triton kernels inside the
    real model under the interpreter (CudaBackend itself insists on a GPU)."""

    name = "cuda"

    def __init__(self) -> None:
        from backends.cuda.attention import CudaAttention
        from backends.cuda.backend import CudaLoRAOps

        self.device = torch.device("cpu")
        self.lora = CudaLoRAOps()
        self.attention = CudaAttention()

    def synchronize(self) -> None:
        return None


def greedy_tokens(runner_mod, model_dir, adapters: dict, backend, dtype: str, new_tokens: int = 8) -> list[list[int]]:
    """Greedy continuations of a mixed batch (adapters and base rows) through ModelRunner:
    one prefill step for all sequences (segment kernels), then batched decode steps
    (per-token kernels)."""
    return greedy_trace(runner_mod, model_dir, adapters, backend, dtype, new_tokens)[0]


def greedy_trace(runner_mod, model_dir, adapters: dict, backend, dtype: str, new_tokens: int = 8,
                 forced: list[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:  # fmt: skip
    """``greedy_tokens`` plus each step's float32 logits on the CPU; with ``forced``, row i is fed
    ``forced[i]`` (teacher forcing) instead of its own argmax, and the argmaxes are returned."""
    from runtime.config import EngineConfig
    from runtime.lora.adapter import load_adapter

    config = EngineConfig(model=str(model_dir), device=backend.device.type, dtype=dtype, max_loras=8, max_lora_rank=64)
    runner = runner_mod.ModelRunner(config, backend)
    row = 0
    names = sorted(adapters)
    for slot, name in enumerate(names):
        adapter = load_adapter(
            adapters[name], name, runner.lora_targets(), num_layers=len(runner.model.layers), max_lora_rank=config.max_lora_rank
        )
        runner.write_adapter(slot, adapter, row)
        row += adapter.max_rank
    seq_slots = [0, -1, *range(1, len(names)), 0, -1]
    gen = torch.Generator().manual_seed(0)
    prompts = [[int(v) for v in torch.randint(3, 250, (5 + i,), generator=gen)] for i in range(len(seq_slots))]
    per_seq = -(-(max(map(len, prompts)) + new_tokens) // runner.block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    outs: list[list[int]] = [[] for _ in prompts]
    step_logits: list[torch.Tensor] = []
    steps = [runner_mod.SeqStep(p, 0, t, s, True) for p, t, s in zip(prompts, tables, seq_slots)]
    for k in range(new_tokens):
        logits = runner.execute(steps)
        step_logits.append(logits.float().cpu())
        nxt = logits.argmax(dim=-1).tolist()
        for i, tok in enumerate(nxt):
            outs[i].append(int(tok))
        fed = [forced[i][k] if forced is not None else outs[i][-1] for i in range(len(prompts))]
        steps = [
            runner_mod.SeqStep([fed[i]], len(prompts[i]) + len(outs[i]) - 1, tables[i], seq_slots[i], True)
            for i in range(len(prompts))
        ]
    return outs, step_logits


@on_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_model_greedy_matches_cpu_backend(tmp_path, dtype: str) -> None:
    """Greedy tokens of a mixed-adapter batch on the cuda backend equal the cpu backend's,
    exactly in fp32. In bf16 the GPU is fed the CPU's tokens (teacher forcing), its logits must
    be within bf16 tolerance of the CPU's, and its argmax must equal the CPU's token wherever the
    CPU's top two logits are more than 4 bf16 rounding steps apart: bf16 rounding differs between
    the kernels and torch's CPU matmuls, so a near-tie (the tiny model has gaps of one step) can
    legitimately go either way."""
    import runtime.model_runner as runner_mod
    from tests.fixtures.tiny_models import build_standard_adapters, build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", "llama", seed=0)
    adapters = build_standard_adapters(model_dir, tmp_path / "adapters")
    from backends import get_backend

    cpu, cpu_logits = greedy_trace(runner_mod, model_dir, adapters, get_backend("cpu"), dtype)
    if dtype == "float32":
        assert greedy_tokens(runner_mod, model_dir, adapters, get_backend("cuda"), dtype) == cpu
        return
    gpu, gpu_logits = greedy_trace(runner_mod, model_dir, adapters, get_backend("cuda"), dtype, forced=cpu)
    decided = 0
    for k, (c, g) in enumerate(zip(cpu_logits, gpu_logits)):
        # CPU bf16 against CPU fp32 on this model differs by up to 0.10 (logits up to ~4): allow twice that.
        torch.testing.assert_close(g, c, rtol=0.0, atol=0.2, msg=lambda m: f"step {k}: {m}")
        top2 = c.topk(2, dim=-1).values
        step = 2.0 ** (torch.floor(torch.log2(top2[:, 0].abs().clamp_min(1e-6))) - 7)  # one bf16 rounding step at that size
        clear = (top2[:, 0] - top2[:, 1]) > 4 * step
        for i in torch.nonzero(clear).flatten().tolist():
            assert gpu[i][k] == cpu[i][k], f"row {i}, step {k}: gpu {gpu[i][k]} vs cpu {cpu[i][k]} with a clear margin"
        decided += int(clear.sum())
    assert decided >= len(cpu) * len(cpu[0]) // 2, "too few positions with a clear margin to mean anything"
