"""Verifiers for paged attention and prefix caching, through ``backend.attention``.

paged_attention: one step mixing a full prefill, a prefill chunk after history and
decode tokens of three sequences with different context lengths (so a padded decode
group masks each row to its own length), then a step whose decodes must be cut into
several groups: where the attention batches decodes under a byte budget (``group_bytes``,
backends/reference.py ``ReferenceAttention``), a copy of it with a budget of two short
sequences runs the step, and the verifier counts the SDPA calls to confirm the groups formed.

prefix_caching: the engine's BlockManager + PrefixCache hand sequence B the blocks of
A's cached prefix (same base, adapter name, version and tokens), and the backend's
attention computes only B's suffix over them, reading K/V written by an earlier step.
B's output must equal dense float64 attention over the whole of B, A's blocks must be
left as A's step wrote them, and another adapter / version / no adapter reuses nothing.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import torch

from runtime.capabilities import Capability, CapabilityMatrix
from runtime.kv.block_manager import BlockManager
from runtime.kv.prefix_cache import PrefixCache
from runtime.request import AdapterRef
from runtime.verifiers.attention_problem import BLOCK_SIZE, HEAD_DIM, HKV, check_attention, random_cache, random_step
from runtime.verifiers.observe import CallCounter
from runtime.verifiers.result import VerificationFailure, VerifierResult, verifier
from runtime.verifiers.sampling import declared_dtypes, fresh_seed, torch_dtype

NUM_BLOCKS = 16


# (new tokens, context) per sequence: a full prefill, a chunk after history, and decode tokens
# of three sequences with different contexts, which batch into one padded, masked group.
MIXED_STEP = ((5, 5), (1, 9), (3, 7), (1, 4), (1, 13))
# Decodes (contexts 3..14, 1..4 blocks) and one chunk; with a budget of two 12-position
# sequences per group they form the groups [3, 6], [9, 11], [14]: masked groups of two.
GROUPED_STEP = ((1, 9), (1, 3), (3, 6), (1, 14), (1, 6), (1, 11))
GROUPED_BUDGET_POSITIONS = 2 * 12


def _tables(context_lens: list[int], g: torch.Generator) -> list[list[int]]:
    """Each sequence's block table, drawn from a shuffled pool (scattered, non-contiguous blocks)."""
    blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, cursor = [], 0
    for ctx in context_lens:
        n = -(-ctx // BLOCK_SIZE)
        tables.append(blocks[cursor : cursor + n])
        cursor += n
    return tables


def _run_step(backend: Any, attention: Any, shape: tuple[tuple[int, int], ...], dtype: torch.dtype,
              g: torch.Generator, tag: str) -> tuple[float, int]:
    """(max err vs dense float64, SDPA calls) for one step of ``shape`` through ``attention``."""
    query_lens, context_lens = [q for q, _ in shape], [c for _, c in shape]
    cache = random_cache(NUM_BLOCKS, dtype, backend.device, g)
    step = random_step(query_lens, context_lens, _tables(context_lens, g), dtype, backend.device, g)
    runner = SimpleNamespace(attention=attention, synchronize=backend.synchronize)
    with CallCounter() as calls:
        err = check_attention(runner, step, cache, dtype, tag)["max_abs_err"]
    return err, calls["scaled_dot_product_attention"]


def grouped_attention(attention: Any, dtype: torch.dtype) -> Any | None:
    """A copy of ``attention`` whose decode groups hold at most ``GROUPED_BUDGET_POSITIONS`` positions
    of K, or None when it does not cut decodes by a byte budget (no ``group_bytes``)."""
    if not hasattr(attention, "group_bytes") or not hasattr(attention, "decode_groups"):
        return None
    small = copy.copy(attention)
    # Counted in the bytes SDPA reads (float32 where the backend upcasts half-precision decodes).
    size = (attention.decode_dtype(dtype) if hasattr(attention, "decode_dtype") else dtype).itemsize
    small.group_bytes = GROUPED_BUDGET_POSITIONS * HKV * HEAD_DIM * size
    return small


@verifier("paged_attention")
def verify_paged_attention(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    """Prefill + chunk + decodes of different lengths in one step, scattered blocks, GQA, vs dense
    float64, per declared dtype; then decodes cut into several groups under a small budget."""
    errs, groups = {}, {}
    for name in declared_dtypes(entry, matrix):
        seed = fresh_seed()
        g = torch.Generator().manual_seed(seed)
        dtype = torch_dtype(name)
        err, _ = _run_step(backend, backend.attention, MIXED_STEP, dtype, g, f"{name} seed {seed}: prefill+chunk+3 decodes")
        small = grouped_attention(backend.attention, dtype)
        if small is not None:
            tag = f"{name} seed {seed}: decodes in groups of {small.group_bytes} bytes"
            grouped_err, sdpa = _run_step(backend, small, GROUPED_STEP, dtype, g, tag)
            chunks = sum(q > 1 for q, _ in GROUPED_STEP)
            decodes = len(GROUPED_STEP) - chunks
            groups[name] = sdpa - chunks
            if not 2 <= groups[name] < decodes:
                raise VerificationFailure(
                    f"paged_attention ({tag}): {decodes} decodes ran as {groups[name]} SDPA group(s); the check needs several "
                    "groups, at least one of several sequences, so it did not verify the grouped decode path"
                )
            err = max(err, grouped_err)
        errs[name] = err
    detail = "prefill+chunk+3 decodes of different lengths in one step, GQA 4:2, scattered blocks"
    if groups:
        detail += f"; {sum(q == 1 for q, _ in GROUPED_STEP)} decodes cut into {min(groups.values())} groups under a small budget"
    detail += "; max err " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items())
    return VerifierResult("pass", detail, {"max_err": errs, "decode_groups": groups})


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
