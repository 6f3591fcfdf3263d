"""A random multi-adapter LoRA problem and its float64 reference, checked on a backend.

The problem: ``T`` rows, each served by an adapter slot or by none (-1), rows of one
adapter scattered (not contiguous), adapters of different ranks stored at their own
rank in flat row buffers sized exactly to the sum of ranks (no room for padding),
several output slices with gaps between them, optionally a slot with rank 0 in a slice
(module not targeted). Slice offsets and y's width are multiples of ``align`` (16 by default,
as a model's projections are, and as torch_npu's fused decode op requires; 1 gives column
0 and odd offsets), and the columns before the first slice and between slices belong to
nobody. ``slot_rows`` gives chosen slots more rows (a segment longer than a kernel's row
tile). Weights are scaled so every value is O(1):

    A_{i,s} ~ N(0, 1/in),  B_{i,s} ~ N(0, 1/r),  scale_{i,s} ~ U(0.5, 2),  x, y ~ N(0, 1)

``shared_scale`` slots use one scale in every slice (their first slice's), as a PEFT adapter
without ``alpha_pattern`` has; ``gap=0`` puts the slices' columns side by side, as a
fused projection's output is laid out. With equal slice widths and interleaved storage
both together are the shape of the CPU backend's one-``baddbmm_`` expand.

Reference (float64, from the values as stored in the compute dtype):

    h[i, t, :r] = x[t] @ A_{i,s}^T ;   y[t, o_i:o_i+n_i] += scale_{i,s} * h[i, t, :r] @ B_{i,s}^T

Checks: shrink against h, expand (fed the reference h) against y, ``apply_lora``
end to end on the rows as drawn and again in engine order (grouped by slot, as
``ModelRunner`` runs a step), and that every entry the contract says is untouched is bit-identical
(outputs are poisoned before each call). ``tight``: the tolerance is on the result, not on the
terms (``numerics.result_magnitude``), for problems whose sums cancel (``accumulation.py``).
The fallbacks the backend noted are returned (``paths.FallbackWatch``): during the direct
shrink/expand calls, and during the ``apply_lora`` calls, the engine's entry point.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from torch import Tensor

from runtime.backend_api import apply_lora
from runtime.lora.batch_meta import NO_ADAPTER, LoRABatchMeta, adapter_order
from runtime.lora.slice_weights import LoRASliceWeights
from runtime.verifiers.numerics import compare, result_magnitude, unchanged
from runtime.verifiers.observe import CallCounter
from runtime.verifiers.paths import FallbackWatch
from runtime.verifiers.result import VerificationFailure

POISON = 7777.0  # finite, so a stray read shows up as a large error rather than NaN noise
GAP = 3  # columns left between output slices; expand must not touch them
ALIGN = 16  # slice offsets and y's width are multiples of this (build_problem's align)


@dataclass(frozen=True)
class LoRAProblem:
    dtype: torch.dtype
    device: torch.device
    x: Tensor  # [T, in], compute dtype, on the device
    token_slots: tuple[int, ...]
    weights: tuple[LoRASliceWeights, ...]
    slice_offsets: tuple[int, ...]
    y_width: int
    ranks: tuple[tuple[int, ...], ...]  # ranks[i][slot], 0 = slice not targeted
    a64: tuple[dict[int, Tensor], ...]  # slice -> slot -> A [r, in] float64
    b64: tuple[dict[int, Tensor], ...]  # slice -> slot -> B [out, r] float64
    scales: tuple[dict[int, float], ...]
    seed: int

    @property
    def max_rank(self) -> int:
        return max(max(r) for r in self.ranks)

    @property
    def num_tokens(self) -> int:
        return len(self.token_slots)


def build_problem(
    device: torch.device,
    dtype: torch.dtype,
    slot_ranks: Sequence[int],
    slice_outs: Sequence[int],
    in_features: int,
    seed: int,
    extra_rows: int = 4,
    no_adapter_rows: int = 3,
    untargeted: frozenset[tuple[int, int]] = frozenset(),
    interleaved: bool = False,
    gap: int = GAP,
    shared_scale: frozenset[int] = frozenset(),
    align: int = ALIGN,
    slot_rows: Sequence[int] = (),
) -> LoRAProblem:
    """Slot s has rank ``slot_ranks[s]`` in every slice except (slice, slot) in ``untargeted``.
    Slots in ``shared_scale`` have one scale across slices; at least ``gap`` columns lie between
    slices, whose offsets, like y's width, are multiples of ``align``; slot s gets ``slot_rows[s]``
    rows on top of its one row and the ``extra_rows`` drawn among all slots.
    ``interleaved``: the slices' A rows share one buffer (``allocate_projection(..., interleaved=True)``; the B rows
    too when the slices have one width), as the model allocates them for ops that set ``interleaved_a``."""
    g = torch.Generator().manual_seed(seed)
    n_slots = len(slot_ranks)
    rows = list(range(n_slots)) + [NO_ADAPTER] * no_adapter_rows
    rows += torch.randint(0, n_slots, (extra_rows,), generator=g).tolist()
    rows += [s for s, n in enumerate(slot_rows) for _ in range(n)]
    token_slots = tuple(rows[i] for i in torch.randperm(len(rows), generator=g).tolist())
    # Pack adapters in a shuffled order into a buffer of exactly sum(ranks) rows.
    order = torch.randperm(n_slots, generator=g).tolist()
    starts, cursor = {}, 0
    for s in order:
        starts[s], cursor = cursor, cursor + slot_ranks[s]
    weights, a64, b64, scales, ranks = [], [], [], [], []
    allocated = LoRASliceWeights.allocate_projection(in_features, list(slice_outs), n_slots, cursor, dtype, device, interleaved)
    for i, (out_features, w) in enumerate(zip(slice_outs, allocated)):
        a_i, b_i, sc_i, r_i = {}, {}, {}, []
        for s, r in enumerate(slot_ranks):
            if (i, s) in untargeted:
                r_i.append(0)
                continue
            a = (torch.randn(r, in_features, generator=g, dtype=torch.float64) / in_features**0.5).to(dtype)
            b = (torch.randn(out_features, r, generator=g, dtype=torch.float64) / r**0.5).to(dtype)
            scale = float(0.5 + 1.5 * torch.rand((), generator=g, dtype=torch.float64))
            if s in shared_scale:  # still drawn, so every other value stays as the seed gives it
                scale = next((sc[s] for sc in scales if s in sc), scale)
            w.write_slot(s, starts[s], a.to(device), b.to(device), scale)
            a_i[s], b_i[s], sc_i[s] = a.double(), b.double(), scale
            r_i.append(r)
        weights.append(w)
        a64.append(a_i), b64.append(b_i), scales.append(sc_i), ranks.append(tuple(r_i))
    offsets, col = [], align  # the columns before the first slice and the gaps belong to nobody
    for out_features in slice_outs:
        offsets.append(col)
        col = -(-(col + out_features + gap) // align) * align
    x = torch.randn(len(token_slots), in_features, generator=g, dtype=torch.float64).to(dtype)
    return LoRAProblem(
        dtype, device, x.to(device), token_slots, tuple(weights), tuple(offsets), col,
        tuple(ranks), tuple(a64), tuple(b64), tuple(scales), seed,
    )


def rewrite_slots(p: LoRAProblem, seed: int) -> LoRAProblem:
    """``p`` after every targeted slot got new A and B of its rank (drawn from ``seed``; the scale
    kept, as for a new version of an adapter with the same rank and alpha), written in place
    through ``write_slot`` as a hot update of an adapter into the same rows does: a backend that
    keeps copies or views of a slot's weights (the reference backend's float32 copies of a
    bfloat16 pool) must compute with the new ones, though no slot table changed."""
    g = torch.Generator().manual_seed(seed)
    in_features = p.x.shape[1]
    a64, b64 = [], []
    for i, w in enumerate(p.weights):
        a_i, b_i = {}, {}
        for s, r in enumerate(p.ranks[i]):
            if r == 0:
                continue
            a = (torch.randn(r, in_features, generator=g, dtype=torch.float64) / in_features**0.5).to(p.dtype)
            b = (torch.randn(w.out_features, r, generator=g, dtype=torch.float64) / r**0.5).to(p.dtype)
            w.write_slot(s, w.host_start[s], a.to(p.device), b.to(p.device), p.scales[i][s])
            a_i[s], b_i[s] = a.double(), b.double()
        a64.append(a_i), b64.append(b_i)
    return replace(p, a64=tuple(a64), b64=tuple(b64), seed=seed)


def reference_shrink(p: LoRAProblem, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """(h [n, T, width] float64, mask of the entries shrink must write, |x| @ |A|^T)."""
    n, t = len(p.weights), p.num_tokens
    h = torch.zeros(n, t, width, dtype=torch.float64)
    mag = torch.zeros(n, t, width, dtype=torch.float64)
    mask = torch.zeros(n, t, width, dtype=torch.bool)
    x = p.x.detach().cpu().double()
    for row, s in enumerate(p.token_slots):
        for i in range(n):
            if s == NO_ADAPTER or p.ranks[i][s] == 0:
                continue
            r = p.ranks[i][s]
            h[i, row, :r] = x[row] @ p.a64[i][s].t()
            mag[i, row, :r] = x[row].abs() @ p.a64[i][s].abs().t()
            mask[i, row, :r] = True
    return h, mask, mag


def reference_expand(p: LoRAProblem, h: Tensor, y0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(y0 + deltas in float64, mask of the entries expand must change, |y0| + s |h| @ |B|^T)."""
    y = y0.detach().cpu().double().clone()
    mag = y.abs()
    mask = torch.zeros_like(y, dtype=torch.bool)
    for row, s in enumerate(p.token_slots):
        for i, w in enumerate(p.weights):
            if s == NO_ADAPTER or p.ranks[i][s] == 0:
                continue
            r, cols = p.ranks[i][s], slice(p.slice_offsets[i], p.slice_offsets[i] + w.out_features)
            y[row, cols] += p.scales[i][s] * (h[i, row, :r] @ p.b64[i][s].t())
            mag[row, cols] += p.scales[i][s] * (h[i, row, :r].abs() @ p.b64[i][s].abs().t())
            mask[row, cols] = True
    return y, mask, mag


def check_lora_ops(backend: Any, p: LoRAProblem, decode_only: bool, observe: bool = False, tight: bool = False) -> dict[str, Any]:
    """Run shrink, expand and apply_lora on ``backend``; raise VerificationFailure on a mismatch.
    ``observe``: also return ``engine_order_calls``, the torch calls (name -> count) the
    engine-order ``apply_lora`` ran (``observe.CallCounter``), for a verifier to check the path.
    ``tight``: tolerances on the results (module docstring). Returns the fallbacks noted as
    ``ops_fallbacks`` (direct shrink/expand) and ``apply_fallbacks`` (both apply_lora calls), watches."""
    path = "per-token" if decode_only else "segment"
    tag = f"{path} {str(p.dtype).removeprefix('torch.')} ranks {sorted(set(r for rr in p.ranks for r in rr) - {0})} seed {p.seed}"
    meta = LoRABatchMeta.build(p.token_slots, p.device, decode_only=decode_only)
    n, t, width = len(p.weights), p.num_tokens, p.max_rank + 2
    if tight:
        tag = "cancelling sums, tolerance on the result: " + tag

    def bound(ref: Tensor, terms: Tensor) -> Tensor:
        """``compare``'s magnitude: the terms' (default), or the result's (``tight``)."""
        return result_magnitude(ref, terms, p.dtype) if tight else terms

    m = "|result| + 2eps32/tol*|terms|" if tight else "|terms|"

    h_ref, h_mask, h_mag = reference_shrink(p, width)
    ops_fallbacks, apply_fallbacks = FallbackWatch(backend), FallbackWatch(backend)

    out = torch.full((n, t, width), POISON, dtype=torch.float32, device=p.device)
    t0 = time.perf_counter()
    with ops_fallbacks:
        backend.lora.shrink(p.x, p.weights, meta, out)
    backend.synchronize()
    shrink_ms = (time.perf_counter() - t0) * 1e3
    got = out.cpu()
    err_shrink = compare(f"shrink ({tag})", got[h_mask], h_ref[h_mask], p.dtype, magnitude=bound(h_ref, h_mag)[h_mask], m=m)
    unchanged(f"shrink ({tag}): no-adapter rows, entries past a row's rank, untargeted slices", got[~h_mask], torch.full_like(got[~h_mask], POISON))

    g = torch.Generator().manual_seed(p.seed + 1)
    y0 = torch.randn(t, p.y_width, generator=g, dtype=torch.float64).to(p.dtype)
    h_in = torch.where(h_mask, h_ref.float(), torch.full_like(h_ref, POISON).float()).to(p.device)
    y = y0.clone().to(p.device)  # clone: .to() on the same device would alias y0
    t0 = time.perf_counter()
    with ops_fallbacks:
        backend.lora.expand(h_in, p.weights, meta, y, p.slice_offsets)
    backend.synchronize()
    expand_ms = (time.perf_counter() - t0) * 1e3
    y_ref, y_mask, y_mag = reference_expand(p, h_ref, y0)
    got_y = y.cpu()
    if got_y.dtype != p.dtype:
        raise VerificationFailure(f"expand ({tag}): y changed dtype to {got_y.dtype}")
    err_expand = compare(f"expand ({tag})", got_y[y_mask], y_ref[y_mask], p.dtype, magnitude=bound(y_ref, y_mag)[y_mask], m=m)
    unchanged(f"expand ({tag}): no-adapter rows, gap columns, untargeted slices", got_y[~y_mask], y0[~y_mask])

    y2 = y0.clone().to(p.device)
    workspace = torch.full((n, t, width), POISON, dtype=torch.float32, device=p.device)
    with apply_fallbacks:
        apply_lora(backend.lora, p.x, y2, p.weights, meta, p.slice_offsets, workspace)
    backend.synchronize()
    # apply_lora rounds h to the op's intermediate precision too: the bound covers both
    # roundings through the shrink magnitudes carried into the expand's terms.
    apply_mag = y_mag.clone()
    for row, s in enumerate(p.token_slots):
        for i, w in enumerate(p.weights):
            if s == NO_ADAPTER or p.ranks[i][s] == 0:
                continue
            r, cols = p.ranks[i][s], slice(p.slice_offsets[i], p.slice_offsets[i] + w.out_features)
            apply_mag[row, cols] += p.scales[i][s] * (h_mag[i, row, :r] @ p.b64[i][s].abs().t())
    apply_mag = bound(y_ref, apply_mag)  # tight: h is exact in the compute dtype (accumulation.py), rounding it costs nothing
    err_apply = compare(f"apply_lora ({tag})", y2.cpu()[y_mask], y_ref[y_mask], p.dtype, scale=2.0, magnitude=apply_mag[y_mask], m=m)
    unchanged(f"apply_lora ({tag}): untouched entries", y2.cpu()[~y_mask], y0[~y_mask])

    # The same rows in engine order (grouped by slot, base rows last, as ModelRunner runs a step).
    order = adapter_order(p.token_slots)
    grouped = LoRABatchMeta.build([p.token_slots[row] for row in order], p.device, decode_only=decode_only)
    perm = torch.tensor(order)
    y3 = y0[perm].clone().to(p.device)
    workspace.fill_(POISON)
    x3 = p.x[perm.to(p.device)]
    calls = CallCounter()
    with calls if observe else contextlib.nullcontext(), apply_fallbacks:
        apply_lora(backend.lora, x3, y3, p.weights, grouped, p.slice_offsets, workspace)
        backend.synchronize()
    err_grouped = compare(f"apply_lora, rows in engine order ({tag})", y3.cpu()[y_mask[perm]], y_ref[perm][y_mask[perm]], p.dtype,
                          scale=2.0, magnitude=apply_mag[perm][y_mask[perm]], m=m)  # fmt: skip
    unchanged(f"apply_lora, rows in engine order ({tag}): untouched entries", y3.cpu()[~y_mask[perm]], y0[perm][~y_mask[perm]])
    return {
        "shrink_err": err_shrink["max_abs_err"],
        "expand_err": err_expand["max_abs_err"],
        "apply_err": max(err_apply["max_abs_err"], err_grouped["max_abs_err"]),
        "tol_used": max(err_shrink["tol_used"], err_expand["tol_used"], err_apply["tol_used"], err_grouped["tol_used"]),
        "shrink_ms": shrink_ms,
        "expand_ms": expand_ms,
        "ops_fallbacks": ops_fallbacks,
        "apply_fallbacks": apply_fallbacks,
        **({"engine_order_calls": dict(calls.counts)} if observe else {}),
    }
