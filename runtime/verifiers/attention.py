"""Verifiers for paged attention and prefix caching, through ``backend.attention``.

prefix_caching: the engine's BlockManager + PrefixCache hand sequence B the blocks of
A's cached prefix (same base, adapter name, version and tokens), and the backend's
attention computes only B's suffix over them, reading K/V written by an earlier step.
B's output must equal dense float64 attention over the whole of B, A's blocks must be
left as A's step wrote them, and another adapter / version / no adapter reuses nothing.
"""
from __future__ import annotations

from typing import Any

import torch

from runtime.capabilities import Capability, CapabilityMatrix
from runtime.kv.block_manager import BlockManager
from runtime.kv.prefix_cache import PrefixCache
from runtime.request import AdapterRef
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
    """Through the engine's BlockManager + PrefixCache: B reuses A's cached prefix blocks and
    computes only its suffix (checked against dense float64 over all of B); a different
    adapter, or a new version of the same adapter, reuses nothing."""
    if not matrix.entry(entry.backend, "paged_attention").supported:
        raise VerificationFailure("prefix caching needs paged_attention, which this backend declares unsupported")
    errs = {}
    for name in declared_dtypes(entry, matrix, matrix.entry(entry.backend, "paged_attention").limits):
        seed = fresh_seed()
        g = torch.Generator().manual_seed(seed)
        dtype = torch_dtype(name)
        tag = f"{name} seed {seed}"
        cache_index = PrefixCache(base_id="probe-base")
        manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE, cache_index)
        adapter = AdapterRef("probe-adapter", "v1")
        prefix = torch.randint(0, 1000, (2 * BLOCK_SIZE,), generator=g).tolist()  # two full blocks
        tokens_a = prefix + torch.randint(0, 1000, (3,), generator=g).tolist()
        tokens_b = prefix + torch.randint(1000, 2000, (5,), generator=g).tolist()
        cache = random_cache(NUM_BLOCKS, dtype, backend.device, g)

        if manager.acquire_prefix("a", cache_index.seed(adapter), tokens_a) != 0:
            raise VerificationFailure(f"prefix_caching ({tag}): an empty cache reported a hit")
        manager.ensure("a", len(tokens_a))
        step_a = random_step([len(tokens_a)], [len(tokens_a)], [manager.table("a")], dtype, backend.device, g)
        check_attention(backend, step_a, cache, dtype, f"{tag}: prefill A")
        manager.commit("a", tokens_a, len(tokens_a))

        reused = manager.acquire_prefix("b", cache_index.seed(adapter), tokens_b)
        if reused != len(prefix) or manager.table("b")[:2] != manager.table("a")[:2]:
            raise VerificationFailure(f"prefix_caching ({tag}): B reused {reused} tokens, expected A's {len(prefix)}-token prefix blocks")
        manager.ensure("b", len(tokens_b))
        prefix_rows = [b * BLOCK_SIZE + j for b in manager.table("a")[:2] for j in range(BLOCK_SIZE)]
        shared = cache[:, prefix_rows].detach().cpu().clone()
        step_b = random_step([len(tokens_b) - reused], [len(tokens_b)], [manager.table("b")], dtype, backend.device, g)
        errs[name] = check_attention(backend, step_b, cache, dtype, f"{tag}: B after cached prefix")["max_abs_err"]
        if not torch.equal(cache[:, prefix_rows].detach().cpu(), shared):
            raise VerificationFailure(f"prefix_caching ({tag}): the shared prefix blocks changed while serving B")

        for other in (AdapterRef("probe-other-adapter", "v1"), AdapterRef("probe-adapter", "v2"), None):
            seq = f"c-{other}"
            if manager.acquire_prefix(seq, cache_index.seed(other), tokens_a) != 0:
                raise VerificationFailure(f"prefix_caching ({tag}): adapter {other} reused KV computed under {adapter}")
    detail = (f"BlockManager+PrefixCache: B reuses A's {2 * BLOCK_SIZE}-token prefix, computes 5 suffix tokens; "
              "other adapter / new version / no adapter reuse nothing; max err " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items()))
    return VerifierResult("pass", detail, {"max_err": errs})
