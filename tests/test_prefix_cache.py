"""Prefix cache: hits for the same (base, adapter, version), none across adapters or after a hot
update, and outputs identical with and without it."""
from __future__ import annotations

import random
from pathlib import Path

from runtime.kv.block_manager import BlockManager
from runtime.kv.prefix_cache import PrefixCache
from runtime.request import AdapterRef, SamplingParams
from tests.engine_helpers import clone_adapter, copy_adapter, make_engine, random_prompt, run_alone, run_to_completion

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def test_hash_chain_depends_on_base_adapter_version_and_every_earlier_token():
    cache = PrefixCache("base")
    tokens = list(range(12))
    chain = lambda seed, toks: PrefixCache.chain(seed, toks, 4, 3)  # noqa: E731
    a1, a2, b1 = AdapterRef("a", "1"), AdapterRef("a", "2"), AdapterRef("b", "1")
    same = chain(cache.seed(a1), tokens)
    assert same == chain(cache.seed(a1), tokens)
    for other in (cache.seed(a2), cache.seed(b1), cache.seed(None), PrefixCache("other").seed(a1)):
        assert not set(chain(other, tokens)) & set(same)
    changed = chain(cache.seed(a1), [99] + tokens[1:])
    assert all(x != y for x, y in zip(changed, same)), "block i depends on tokens of blocks < i"


def test_block_manager_reuses_cached_blocks_and_evicts_lru():
    cache = PrefixCache("base")
    bm = BlockManager(6, 4, cache)
    seed = cache.seed(None)
    prompt = list(range(10))
    assert bm.acquire_prefix("s1", seed, prompt) == 0
    assert bm.ensure("s1", 10)
    bm.commit("s1", prompt, 10)
    first = bm.table("s1")[:2]
    bm.free("s1")
    assert bm.num_free_blocks == 6
    assert bm.acquire_prefix("s2", seed, prompt) == 8 and bm.table("s2") == first
    # Reused, the cached blocks are no longer evictable: no other allocation may take them meanwhile.
    assert bm.num_free_blocks == 4 and bm.ensure("other", 16) and not set(bm.table("other")) & set(first)
    assert not bm.ensure("more", 1)
    bm.free("other")
    assert bm.acquire_prefix("s3", seed, prompt) == 8 and bm.refcount(first[0]) == 2
    bm.free("s2")
    bm.free("s3")
    assert bm.ensure("big", 24)  # needs all 6 blocks: cached ones get evicted
    assert bm.acquire_prefix("s4", seed, prompt) == 0


def _hits(engine):
    return engine.snapshot()["prefix_cache_hit_blocks"]


def test_engine_prefix_hits_only_for_same_adapter_and_version(tiny_llama_dir, tiny_adapters, tmp_path):
    engine = make_engine(tiny_llama_dir, enable_prefix_caching=True)
    live = copy_adapter(Path(tiny_adapters["b"]), tmp_path / "live")
    engine.register_adapter("live", str(live))
    engine.register_adapter("a", str(tiny_adapters["a"]))
    prompt = random_prompt(random.Random(2), 14)
    prefills: list[tuple[int, int]] = []  # (start position, tokens) of each prompt chunk the model computed
    execute = engine.runner.execute

    def recording_execute(steps):
        prefills.extend((s.start_pos, len(s.token_ids)) for s in steps if s.start_pos < len(prompt))
        return execute(steps)

    engine.runner.execute = recording_execute
    first = run_alone(engine, "p1", prompt, PARAMS, "live")
    assert _hits(engine) == 0 and prefills == [(0, 14)]
    prefills.clear()
    second = run_alone(engine, "p2", prompt, PARAMS, "live")
    assert _hits(engine) == 3 and second.token_ids == first.token_ids  # 3 full blocks of 4 below 14 tokens
    assert prefills == [(12, 2)], "a hit must skip the cached tokens' compute, not only count them"
    run_alone(engine, "other-adapter", prompt, PARAMS, "a")
    run_alone(engine, "base", prompt, PARAMS, None)
    assert _hits(engine) == 3, "KV is never shared across adapters"
    clone_adapter(Path(tiny_adapters["b"]), tmp_path / "live", seed=321)
    engine.register_adapter("live", str(live))  # hot update: new version
    run_alone(engine, "after-update", prompt, PARAMS, "live")
    assert _hits(engine) == 3, "KV is never shared across versions"


def test_outputs_identical_with_and_without_prefix_cache(tiny_llama_dir, tiny_adapters):
    rng = random.Random(9)
    shared = random_prompt(rng, 12)
    workload = [(f"r{i}", shared + random_prompt(rng, rng.randint(1, 6)), rng.choice([None, "a", "c"])) for i in range(10)]
    results = []
    for enabled in (False, True):
        engine = make_engine(tiny_llama_dir, enable_prefix_caching=enabled, max_num_batched_tokens=16)
        for name in ("a", "c"):
            engine.register_adapter(name, str(tiny_adapters[name]))
        for rid, prompt, ad in workload[:3]:  # warm the cache, then send the rest together
            run_alone(engine, "warm-" + rid, prompt, PARAMS, ad)
        for rid, prompt, ad in workload:
            engine.add_request(rid, prompt, PARAMS, ad)
        finals = run_to_completion(engine)
        results.append({rid: finals[rid].token_ids for rid, _, _ in workload})
        if enabled:
            assert _hits(engine) > 0
    assert results[0] == results[1]


def test_hit_statistics_count_admitted_lookups_only():
    """A lookup whose admission fails (the scheduler frees the table and retries later) is not
    counted; the one that is admitted is, once."""
    cache = PrefixCache("base")
    bm = BlockManager(num_blocks=8, block_size=4, prefix_cache=cache)
    seed, prompt = cache.seed(None), list(range(12))
    bm.acquire_prefix("s1", seed, prompt)
    bm.ensure("s1", 12)
    bm.count_prefix_lookup("s1")
    bm.commit("s1", prompt, 12)
    bm.free("s1")
    assert (cache.queried_blocks, cache.hit_blocks) == (2, 0)
    for _ in range(3):  # three failed admission attempts
        assert bm.acquire_prefix("s2", seed, prompt) == 8
        bm.free("s2")
    assert (cache.queried_blocks, cache.hit_blocks) == (2, 0)
    bm.acquire_prefix("s2", seed, prompt)
    bm.count_prefix_lookup("s2")
    assert (cache.queried_blocks, cache.hit_blocks) == (4, 2)


def test_a_prompt_block_in_flight_is_waited_for_not_computed_twice():
    cache = PrefixCache("base")
    bm = BlockManager(16, 4, cache)
    seed = cache.seed(None)
    prompt = list(range(10))  # blocks 0-1 full and cacheable, the last token in block 2
    assert not bm.prefix_in_flight("w1", seed, prompt)
    assert bm.acquire_prefix("s1", seed, prompt) == 0 and bm.ensure("s1", 10)
    assert bm.prefix_in_flight("w2", seed, prompt) and bm.prefix_in_flight("w3", seed, prompt[:9] + [77])  # shares block 0
    assert not bm.prefix_in_flight("w4", seed, [5] + prompt[1:]) and not bm.prefix_in_flight("w5", cache.seed(AdapterRef("a", "1")), prompt)
    bm.commit("s1", prompt, 4)  # block 0 published, block 1 still computing
    assert bm.prefix_in_flight("w6", seed, prompt) and not bm.prefix_in_flight("w7", seed, prompt[:4] + [9, 9, 9, 9, 9, 9])
    bm.commit("s1", prompt, 8)
    assert not bm.prefix_in_flight("w8", seed, prompt)
    assert bm.acquire_prefix("s2", seed, prompt) == 8
    # A sequence freed before publishing (preempted, aborted) leaves nothing in flight.
    other = list(range(50, 60))
    bm.acquire_prefix("s3", seed, other)
    assert bm.prefix_in_flight("w9", seed, other)
    bm.free("s3")
    assert not bm.prefix_in_flight("w10", seed, other)


def test_identical_prompts_admitted_together_share_their_blocks(tiny_llama_dir, tiny_adapters):
    """n choices of one prompt, or a burst with one system prompt: the first computes the shared
    blocks, the others wait one step and reuse them; outputs equal those without the cache."""
    rng = random.Random(8)
    shared = random_prompt(rng, 30)
    jobs = [(shared, "a")] * 4 + [(shared[:24] + random_prompt(rng, 6), "a"), (shared, None), (random_prompt(rng, 30), "a")]
    finals = {}
    for caching in (False, True):
        engine = make_engine(tiny_llama_dir, num_kv_blocks=128, max_num_batched_tokens=256, enable_prefix_caching=caching)
        engine.register_adapter("a", str(tiny_adapters["a"]))
        for i, (prompt, adapter) in enumerate(jobs):
            engine.add_request(f"r{i}", prompt, PARAMS, adapter)
        finals[caching] = {rid: out.token_ids for rid, out in run_to_completion(engine).items()}
        if caching:
            # Three copies reuse 7 blocks each ((30 - 1) // 4); the one sharing 24 tokens reuses 6; the
            # base-model copy and the unrelated prompt share nothing with adapter "a"'s blocks.
            assert _hits(engine) == 3 * 7 + 6
    assert finals[True] == finals[False]
