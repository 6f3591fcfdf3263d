"""Verifiers for paged attention and prefix caching, through ``backend.attention``.

prefix_caching, at the backend level, means: two sequences share physical KV blocks
through their block tables, and a later prefill computes only the tokens after the
cached prefix, reading the prefix's K/V written by an earlier step. The check: step 1
prefills sequence A; step 2 prefills only B's suffix over A's shared prefix blocks;
B's output must equal dense float64 attention over the whole of B, and A's blocks
must be left as step 1 wrote them.
"""
from __future__ import annotations

from typing import Any

import torch

from runtime.capabilities import Capability, CapabilityMatrix
from runtime.verifiers.attention_problem import BLOCK_SIZE, check_attention, random_cache, random_step
from runtime.verifiers.result import VerificationFailure, VerifierResult, verifier
from runtime.verifiers.sampling import declared_dtypes, fresh_seed, torch_dtype

NUM_BLOCKS = 16


@verifier("paged_attention")
def verify_paged_attention(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    """Mixed prefill / decode / chunk step, scattered blocks, GQA, vs dense float64, per declared dtype."""
    errs = {}
    for name in declared_dtypes(entry, matrix):
        seed = fresh_seed()
        g = torch.Generator().manual_seed(seed)
        blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        # (new tokens, context): a full prefill, one decode token after history, a chunk after history
        query_lens, context_lens = [5, 1, 3], [5, 9, 7]
        tables, cursor = [], 0
        for ctx in context_lens:
            n = -(-ctx // BLOCK_SIZE)
            tables.append(blocks[cursor : cursor + n])
            cursor += n
        dtype = torch_dtype(name)
        cache = random_cache(NUM_BLOCKS, dtype, backend.device, g)
        step = random_step(query_lens, context_lens, tables, dtype, backend.device, g)
        errs[name] = check_attention(backend, step, cache, dtype, f"{name} seed {seed}")["max_abs_err"]
    detail = "prefill+decode+chunk, GQA 4:2, scattered blocks; max err " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items())
    return VerifierResult("pass", detail, {"max_err": errs})


@verifier("prefix_caching")
def verify_prefix_caching(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    """A second sequence reuses the first one's prefix blocks and computes only its suffix."""
    if not matrix.entry(entry.backend, "paged_attention").supported:
        raise VerificationFailure("prefix caching needs paged_attention, which this backend declares unsupported")
    errs = {}
    for name in declared_dtypes(entry, matrix, matrix.entry(entry.backend, "paged_attention").limits):
        seed = fresh_seed()
        g = torch.Generator().manual_seed(seed)
        dtype = torch_dtype(name)
        blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        prefix_blocks, a_tail, b_tail = blocks[:2], blocks[2:4], blocks[4:6]
        prefix = 2 * BLOCK_SIZE  # cached prefix: two full blocks
        cache = random_cache(NUM_BLOCKS, dtype, backend.device, g)
        a_len, b_len = prefix + 3, prefix + 5
        step_a = random_step([a_len], [a_len], [prefix_blocks + a_tail], dtype, backend.device, g)
        check_attention(backend, step_a, cache, dtype, f"{name} seed {seed}: prefill A")
        shared = cache[:, [b * BLOCK_SIZE + j for b in prefix_blocks for j in range(BLOCK_SIZE)]].detach().cpu().clone()
        step_b = random_step([b_len - prefix], [b_len], [prefix_blocks + b_tail], dtype, backend.device, g)
        errs[name] = check_attention(backend, step_b, cache, dtype, f"{name} seed {seed}: B after cached prefix")["max_abs_err"]
        after = cache[:, [b * BLOCK_SIZE + j for b in prefix_blocks for j in range(BLOCK_SIZE)]].detach().cpu()
        if not torch.equal(after, shared):
            raise VerificationFailure("prefix_caching: the shared prefix blocks changed while serving the second sequence")
    detail = f"B reuses A's {2} prefix blocks, computes {5} suffix tokens; max err " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items())
    return VerifierResult("pass", detail, {"max_err": errs})
