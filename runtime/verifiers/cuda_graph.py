"""Verifier for cuda_graph_safety: capture the LoRA ops in a CUDA graph, replay with new inputs.

A forward that reads device data on the host (``.item()``, ``.tolist()``, a sync) cannot
be captured; one that bakes host values into the graph gives wrong results on replay.
So (``check_replay``): warm up on a side stream, capture ``apply_lora`` (segment and
per-token metadata), then write into the captured buffers fresh x and y and other slots for
the rows (``new_slots``), replay, and compare with float64: the adapter entries with the new
slots' deltas, every other entry of y bit-identical to what was written before the replay.

The new slots keep the metadata's shape, which the segment kernels' grid is captured with
(capability_matrix.yaml, cuda.cuda_graph_safety): the adapters in use are cycled among their
slots (so each serves another adapter's rank and weights) and the rows shuffled, so the
segment lengths, tiles and number of adapter rows are the same multiset. Only the device
copies of the metadata are rewritten, in place; the host mirrors keep the captured values,
as a replayed graph would.

On a backend that declares it unsupported the capability is not applicable, not refused:
the engine never captures CUDA graphs and nothing in runtime/ or backends/ calls
``require("cuda_graph_safety")``, so there is no gate whose refusal could be checked.
The verifier reports skipped ("not applicable") there rather than a pass.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from runtime.backend_api import apply_lora
from runtime.capabilities import Capability, CapabilityMatrix
from runtime.lora.batch_meta import NO_ADAPTER, LoRABatchMeta
from runtime.verifiers.lora_ops import IN_FEATURES, QKV_OUTS
from runtime.verifiers.lora_problem import LoRAProblem, build_problem, reference_expand, reference_shrink
from runtime.verifiers.numerics import compare, unchanged
from runtime.verifiers.result import NOT_APPLICABLE, VerificationFailure, VerifierResult, verifier
from runtime.verifiers.sampling import fresh_seed, pick_ranks, torch_dtype

Capture = Callable[[Callable[[], None]], Callable[[], None]]  # capture(fn) -> replay
META_TENSORS = ("token_slots", "sorted_tokens", "seg_slots", "seg_starts", "seg_tiles")


def cuda_graph_capture(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` once on a side stream (compile, build the slice tables), capture it in a CUDA graph;
    returns the graph's ``replay``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def new_slots(slots: Sequence[int], g: torch.Generator) -> list[int]:
    """``slots`` with the adapters in use cycled (the k-th used slot -> the (k+1)-th) and the rows shuffled."""
    used = sorted(set(slots) - {NO_ADAPTER})
    cycle = {s: used[(k + 1) % len(used)] for k, s in enumerate(used)}
    return [cycle.get(slots[i], NO_ADAPTER) for i in torch.randperm(len(slots), generator=g).tolist()]


def check_replay(backend: Any, p: LoRAProblem, decode_only: bool, capture: Capture) -> float:
    """Capture ``apply_lora`` over ``p`` with ``capture``, replay with new x, y and slots (module
    docstring); returns the max error, raises VerificationFailure on a mismatch or a stray write."""
    meta = LoRABatchMeta.build(p.token_slots, backend.device, decode_only=decode_only)
    x = p.x.clone()
    y = torch.zeros(p.num_tokens, p.y_width, dtype=p.dtype, device=backend.device)
    workspace = torch.zeros(len(p.weights), p.num_tokens, p.max_rank, dtype=torch.float32, device=backend.device)
    replay = capture(lambda: apply_lora(backend.lora, x, y, p.weights, meta, p.slice_offsets, workspace))

    g = torch.Generator().manual_seed(p.seed + 7)
    slots = new_slots(p.token_slots, g)
    fresh = LoRABatchMeta.build(slots, backend.device, decode_only=decode_only)
    for name in META_TENSORS:
        captured, new = getattr(meta, name), getattr(fresh, name)
        if captured.shape != new.shape:
            raise AssertionError(f"new_slots changed the shape of {name}: {tuple(captured.shape)} -> {tuple(new.shape)}")
        captured.copy_(new)
    new_x = torch.randn(p.x.shape, generator=g, dtype=torch.float64).to(p.dtype)
    y0 = torch.randn(y.shape, generator=g, dtype=torch.float64).to(p.dtype)
    x.copy_(new_x.to(backend.device))
    y.copy_(y0.to(backend.device))
    replay()
    backend.synchronize()

    replayed = dataclasses.replace(p, x=new_x, token_slots=tuple(slots))
    h_ref, _, _ = reference_shrink(replayed, p.max_rank)
    y_ref, mask, y_mag = reference_expand(replayed, h_ref, y0)
    tag = f"graph replay ({'per-token' if decode_only else 'segment'}, {str(p.dtype).removeprefix('torch.')}, seed {p.seed}, "
    tag += f"slots {list(p.token_slots)} -> {slots})"
    got = y.cpu()
    err = compare(tag, got[mask], y_ref[mask], p.dtype, scale=2.0, magnitude=y_mag[mask] + 1.0)["max_abs_err"]
    unchanged(f"{tag}: rows with no adapter and columns outside the slices", got[~mask], y0[~mask])
    return err


@verifier("cuda_graph_safety", refusal=NOT_APPLICABLE)
def verify_cuda_graph_safety(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    if backend.device.type != "cuda":
        raise VerificationFailure(f"graph capture needs a cuda device; the backend runs on {backend.device}")
    name = matrix.entry(entry.backend, "dtypes").limits.dtypes[0]
    errs = {}
    for decode_only in (False, True):
        seed = fresh_seed()
        ranks = pick_ranks(matrix.entry(entry.backend, "mixed_ranks").limits, 3, seed)
        p = build_problem(backend.device, torch_dtype(name), ranks, QKV_OUTS, IN_FEATURES, seed)
        errs["per-token" if decode_only else "segment"] = check_replay(backend, p, decode_only, cuda_graph_capture)
    detail = "captured, replayed with new inputs and other adapters in the rows; untouched entries unchanged; max err "
    return VerifierResult("pass", detail + ", ".join(f"{k} {v:.2g}" for k, v in errs.items()), {"max_err": errs})
