"""BlockManager: block tables, all-or-nothing growth, refcounts, free lists."""
from __future__ import annotations

from hypothesis import example, given, settings, strategies as st

from runtime.kv.block_manager import BlockManager


def test_tables_grow_by_block_and_free_returns_everything():
    bm = BlockManager(5, 4)
    bm.acquire_prefix("a", None, [1, 2, 3])
    assert bm.ensure("a", 1) and len(bm.table("a")) == 1
    assert bm.ensure("a", 4) and len(bm.table("a")) == 1
    assert bm.ensure("a", 5) and len(bm.table("a")) == 2
    assert bm.ensure("b", 12) and len(bm.table("b")) == 3
    assert not bm.ensure("c", 1) and bm.table("c") == []  # all or nothing
    assert not set(bm.table("a")) & set(bm.table("b"))
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 5 and bm.total_refcount == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 20)), max_size=40))
def test_random_growth_and_frees_keep_blocks_disjoint(ops):
    bm = BlockManager(10, 4)
    sizes: dict[str, int] = {}
    for seq, n in ops:
        sid = f"s{seq}"
        if n == 0:
            bm.free(sid)
            sizes.pop(sid, None)
            continue
        before = list(bm.table(sid))
        ok = bm.ensure(sid, max(n, sizes.get(sid, 0)))
        if ok:
            sizes[sid] = max(n, sizes.get(sid, 0))
            assert bm.table(sid)[: len(before)] == before
        else:
            assert bm.table(sid) == before
        used = [b for s in sizes for b in bm.table(s)]
        assert len(used) == len(set(used)) and len(used) + bm.num_free_blocks == 10


# ---- prefix cache: random operation sequences against a model of the KV contents --------------
# The model: a "KV store" per block slot holding what was written there, as the (seed, tokens up to
# and including that position) that determine a real KV entry. A sequence may only ever read
# entries equal to what it would have computed itself; refcounts must equal table membership.

_PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [])


def _check_invariants(bm, live: dict, kv: dict) -> None:
    users: dict[int, int] = {}
    for sid, (seed, tokens, computed) in live.items():
        table = bm.table(sid)
        assert len(table) == len(set(table)), f"{sid}: a block twice in one table"
        assert len(table) * bm.block_size >= computed
        for b in table:
            users[b] = users.get(b, 0) + 1
        for j in range(computed):  # every entry the sequence reads holds its own KV
            assert kv.get((table[j // bm.block_size], j % bm.block_size)) == (seed, tuple(tokens[: j + 1])), (sid, j)
    for b in range(bm.num_blocks):
        assert bm.refcount(b) == users.get(b, 0), f"block {b}: refcount {bm.refcount(b)}, in {users.get(b, 0)} tables"
    assert bm.num_free_blocks == sum(1 for b in range(bm.num_blocks) if users.get(b, 0) == 0)
    cache = bm.prefix_cache
    for block_hash, b in cache._by_hash.items():  # a cached block holds full, computed KV of its hash
        assert cache._hash_of_block[b] == block_hash
    pending: dict[bytes, int] = {}
    for hashes in bm._to_publish.values():
        for h in hashes:
            pending[h] = pending.get(h, 0) + 1
    assert bm._in_flight == pending


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 3), st.integers(0, 2), st.lists(st.integers(0, 2), max_size=9),
                  st.integers(0, 1), st.booleans(), st.integers(1, 12)),
        st.tuples(st.just("step"), st.integers(0, 3), st.integers(1, 12), st.integers(0, 2)),
        st.tuples(st.just("free"), st.integers(0, 3)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_OPS, st.integers(3, 5), st.integers(2, 4))
# A hit on blocks whose last user has gone (refcount 0, evictable), then allocation pressure: the
# random draws above never reuse an evictable block, so without this example a block manager that
# left a reused block evictable (free for the next allocation while a table reads it) passed.
@example(ops=[("admit", 0, 0, [], 0, True, 12), ("free", 0), ("admit", 1, 0, [], 0, True, 12), ("admit", 2, 2, [0] * 9, 1, True, 12),
              ("step", 1, 12, 0), ("step", 2, 12, 0)], num_blocks_per_4=3, block_size=2)  # fmt: skip
def test_prefix_sharing_never_reads_foreign_kv_and_refcounts_match_tables(ops, num_blocks_per_4, block_size):
    """Admissions with shared prefixes (hits, on blocks in use and on evictable ones), chunked
    prefill with commits, decode growth, preemption (free, then readmission with the output kept)
    and frees, in random order."""
    from runtime.kv.prefix_cache import PrefixCache
    from runtime.request import AdapterRef

    cache = PrefixCache("base")
    bm = BlockManager(num_blocks_per_4 * 4, block_size, cache)
    seeds = [cache.seed(None), cache.seed(AdapterRef("a", "1"))]
    live: dict[str, tuple[bytes, list[int], int]] = {}  # running: seed, tokens, tokens computed
    parked: dict[str, tuple[bytes, list[int]]] = {}  # preempted: seed, tokens (prompt + output so far)
    kv: dict[tuple[int, int], tuple] = {}

    def compute(sid: str, n: int) -> bool:
        seed, tokens, computed = live[sid]
        if not bm.ensure(sid, computed + n):
            return False
        table = bm.table(sid)
        for j in range(computed, computed + n):
            kv[(table[j // block_size], j % block_size)] = (seed, tuple(tokens[: j + 1]))
        live[sid] = (seed, tokens, computed + n)
        would = bm.has_blocks_to_commit(sid, computed + n)  # the engine builds the token list only then
        published = len(bm._hashes.get(sid, []))
        bm.commit(sid, tokens, computed + n)
        assert would == (len(bm._hashes.get(sid, [])) > published), (sid, computed + n)
        return True

    for op in ops:
        kind, sid = op[0], f"s{op[1]}"
        if kind == "admit" and sid not in live:
            _, _, prefix, tail, adapter, reuse, chunk = op
            seed, tokens = parked.pop(sid, (seeds[adapter], _PREFIXES[prefix] + tail))
            if not tokens:
                tokens = [0]
            reused = bm.acquire_prefix(sid, seed, tokens, reuse=reuse)
            assert reused % block_size == 0 and reused <= len(tokens) - 1 and (reuse or reused == 0)
            live[sid] = (seed, tokens, reused)
            _check_invariants(bm, live, kv)  # the reused blocks hold this prompt's KV
            if not compute(sid, min(chunk, len(tokens) - reused)):
                bm.free(sid)  # not admitted: waits again with its tokens
                del live[sid]
                parked[sid] = (seed, tokens)
        elif kind == "step" and sid in live:
            _, _, chunk, token = op
            seed, tokens, computed = live[sid]
            if computed == len(tokens):  # decode: the sampled token joins the sequence
                tokens = tokens + [token]
                live[sid] = (seed, tokens, computed)
            if not compute(sid, min(chunk, len(tokens) - computed)):
                bm.free(sid)  # preempted by recompute
                del live[sid]
                parked[sid] = (seed, tokens)
        elif kind == "free":
            bm.free(sid)
            live.pop(sid, None)
            parked.pop(sid, None)
        _check_invariants(bm, live, kv)
    for sid in list(live):
        bm.free(sid)
    live.clear()
    _check_invariants(bm, live, kv)
    assert bm.num_free_blocks == bm.num_blocks and not bm._in_flight


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=12), st.lists(st.integers(0, 9), max_size=12), st.data())
def test_token_ids_between_is_a_slice_of_all_token_ids(prompt, output, data):
    """The engine's per-step chunk (``Sequence.token_ids_between``) equals slicing prompt + output,
    across the prompt/output boundary and at both ends."""
    from runtime.request import SamplingParams, Sequence

    seq = Sequence("r", 0, prompt, SamplingParams(), None, 0.0, output_token_ids=list(output))
    total = len(prompt) + len(output)
    start = data.draw(st.integers(0, total))
    end = data.draw(st.integers(start, total))
    assert seq.token_ids_between(start, end) == seq.all_token_ids[start:end]
