"""Verifier for cuda_graph_safety: capture the LoRA ops in a CUDA graph, replay with new inputs.

A forward that reads device data on the host (``.item()``, ``.tolist()``, a sync) cannot
be captured; one that bakes host values into the graph gives wrong results on replay.
So: warm up on a side stream, capture ``apply_lora`` (segment and per-token metadata),
copy fresh x / y into the captured buffers, replay, and compare with float64.

On a backend that declares it unsupported the capability is not applicable, not refused:
the engine never captures CUDA graphs and nothing in runtime/ or backends/ calls
``require("cuda_graph_safety")``, so there is no gate whose refusal could be checked.
The verifier reports skipped ("not applicable") there rather than a pass.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from runtime.backend_api import apply_lora
from runtime.capabilities import Capability, CapabilityMatrix
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.verifiers.lora_ops import IN_FEATURES, QKV_OUTS
from runtime.verifiers.lora_problem import build_problem, reference_expand, reference_shrink
from runtime.verifiers.numerics import compare
from runtime.verifiers.result import NOT_APPLICABLE, VerificationFailure, VerifierResult, verifier
from runtime.verifiers.sampling import fresh_seed, pick_ranks, torch_dtype


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
        meta = LoRABatchMeta.build(p.token_slots, backend.device, decode_only=decode_only)
        x = p.x.clone()
        y = torch.zeros(p.num_tokens, p.y_width, dtype=p.dtype, device=backend.device)
        workspace = torch.zeros(len(p.weights), p.num_tokens, p.max_rank, dtype=torch.float32, device=backend.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile / autotune outside the capture
            apply_lora(backend.lora, x, y, p.weights, meta, p.slice_offsets, workspace)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            apply_lora(backend.lora, x, y, p.weights, meta, p.slice_offsets, workspace)
        g = torch.Generator().manual_seed(seed + 7)
        new_x = torch.randn(p.x.shape, generator=g, dtype=torch.float64).to(p.dtype)
        y0 = torch.randn(y.shape, generator=g, dtype=torch.float64).to(p.dtype)
        x.copy_(new_x.to(backend.device))
        y.copy_(y0.to(backend.device))
        graph.replay()
        torch.cuda.synchronize()
        replayed = dataclasses.replace(p, x=new_x)
        h_ref, _, h_mag = reference_shrink(replayed, p.max_rank)
        y_ref, mask, y_mag = reference_expand(replayed, h_ref, y0)
        path = "per-token" if decode_only else "segment"
        errs[path] = compare(f"graph replay ({path}, {name}, seed {seed})", y.cpu()[mask], y_ref[mask], p.dtype, scale=2.0, magnitude=y_mag[mask] + 1.0)["max_abs_err"]
    return VerifierResult("pass", "captured + replayed with new inputs; max err " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items()), {"max_err": errs})
