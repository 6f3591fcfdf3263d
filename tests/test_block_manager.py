"""BlockManager: block tables, all-or-nothing growth, refcounts, free lists."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

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
