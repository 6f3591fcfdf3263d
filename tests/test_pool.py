"""AdapterPool properties (hypothesis): capacity, referenced entries never evicted, LRU order,
hot update never changes a running request's weights, abort brings refcounts to zero."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
from hypothesis import example, given, settings, strategies as st

from runtime.lora.pool import AdapterPool
from runtime.request import AdapterRef


@dataclass(frozen=True)
class FakeAdapter:
    name: str
    version: str
    max_rank: int

    @property
    def nbytes(self) -> int:
        """Host bytes, growing with the rank as a real adapter's do (``max_cpu_lora_bytes`` tests)."""
        return self.max_rank * 1000


class FakeWriter:
    """Records what each slot holds and which rows each slot's weights occupy."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[AdapterRef, int, int]] = {}

    def write_adapter(self, slot: int, adapter: FakeAdapter, row_start: int) -> None:
        self.slots[slot] = (AdapterRef(adapter.name, adapter.version), row_start, adapter.max_rank)

    def clear_slot(self, slot: int) -> None:
        self.slots.pop(slot, None)


RANKS = (4, 8, 16, 32)


def make_pool(max_loras=3, max_cpu_loras=4, pool_rows=48, stale: set | None = None, max_cpu_lora_bytes=None):
    """``stale``: versions whose files changed on disk (an in-place update): reading them fails."""
    writer = FakeWriter()
    adapters: dict[AdapterRef, FakeAdapter] = {}

    def loader(ref: AdapterRef) -> FakeAdapter:
        if stale is not None and ref in stale:
            raise ValueError(f"{ref}: the adapter changed on disk since it was registered")
        return adapters[ref]

    pool = AdapterPool(writer, loader, max_loras, max_cpu_loras, pool_rows, max_lora_rank=32, row_bytes=10, async_loads=False,
                       max_cpu_lora_bytes=max_cpu_lora_bytes)
    return pool, writer, adapters


def new_ref(adapters, name: str, version: int, rank: int) -> AdapterRef:
    ref = AdapterRef(name, f"v{version}")
    adapters[ref] = FakeAdapter(name, f"v{version}", rank)
    return ref


ops = st.lists(
    st.tuples(st.sampled_from(["demand", "acquire", "release", "finish", "update", "abort_all"]), st.integers(0, 5), st.integers(0, 3)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
# An idle device resident pushed out of a full host tier by three loads (random draws hit this
# about once in 300 examples): it must leave the device too.
@example(operations=[("demand", 0, 0), ("acquire", 0, 0), ("finish", 0, 0), ("demand", 1, 0), ("demand", 2, 0), ("demand", 3, 0)])
# 3: a host tier no larger than the device's, evicting device residents often. A byte bound of 40000
# (FakeAdapter: 1000 bytes a rank, ranks 4..32) holds one rank-32 adapter with one of rank 8 at most,
# alone or with an entry bound.
@pytest.mark.parametrize("max_cpu_loras, max_cpu_lora_bytes", [(3, None), (4, None), (None, 40_000), (4, 40_000)])
def test_pool_invariants_under_random_operations(max_cpu_loras, max_cpu_lora_bytes, operations):
    stale: set[AdapterRef] = set()  # retired versions' files were overwritten in place: no disk read can bring them back
    pool, writer, adapters = make_pool(max_cpu_loras=max_cpu_loras, stale=stale, max_cpu_lora_bytes=max_cpu_lora_bytes)
    current = {f"n{i}": new_ref(adapters, f"n{i}", 0, RANKS[i % 4]) for i in range(6)}
    versions = {name: 0 for name in current}
    live: list[dict] = []  # each request: ref, running(bool)
    pinned: set[AdapterRef] = set()  # demanded versions seen on the host: they must stay there
    for op, k, r in operations:
        name = f"n{k}"
        if op == "demand":
            pool.demand(current[name])
            live.append({"ref": current[name], "running": False})
        elif op == "acquire":
            waiting = [q for q in live if not q["running"] and pool.weights_ready(q["ref"])]
            if waiting:
                q = waiting[r % len(waiting)]
                slot = pool.acquire_device(q["ref"])
                if slot is not None:
                    q["running"], q["slot"] = True, slot
                    q["weights"] = writer.slots[slot]
        elif op == "release":
            running = [q for q in live if q["running"]]
            if running:
                q = running[r % len(running)]
                pool.release_device(q["ref"])
                q["running"] = False
        elif op == "finish" and live:
            q = live.pop(r % len(live))
            if q["running"]:
                pool.release_device(q["ref"])
            pool.undemand(q["ref"])
        elif op == "update":  # hot update: a new version becomes current, the old one retires
            versions[name] += 1
            old = current[name]
            current[name] = new_ref(adapters, name, versions[name], RANKS[(k + versions[name]) % 4])
            pool.retire(old)
            stale.add(old)
        elif op == "abort_all":
            for q in live:
                if q["running"]:
                    pool.release_device(q["ref"])
                pool.undemand(q["ref"])
            live.clear()
        failures = pool.poll()
        # A version that requests want and that was in memory stays in memory: it never needs a disk read.
        assert not [f for f in failures if f.ref in pinned], failures
        snap = pool.snapshot()
        # capacity
        assert max_cpu_loras is None or snap["host_entries"] + snap["loads_in_flight"] <= max_cpu_loras
        assert snap["host_bytes_in_use"] == sum(adapters[ref].nbytes for ref in pool.host_refs())
        assert max_cpu_lora_bytes is None or snap["host_bytes_in_use"] <= max_cpu_lora_bytes  # (no load stays in flight: async_loads=False)
        assert snap["device_rows_used"] <= 48  # (slots cannot exceed 3: there are 3 list entries)
        residents = pool.device_residents()
        assert len({ref for ref, _, _ in residents.values()}) == len(residents), "an adapter resident in two slots"
        spans = sorted((start, start + rows) for _, start, rows in residents.values())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "row ranges overlap"
        assert all(rows == adapters[ref].max_rank for ref, _, rows in residents.values()), "rows follow the actual rank"
        # referenced entries stay; a running request's slot still holds exactly the weights it started with
        for q in live:
            if q["running"]:
                assert writer.slots.get(q["slot"]) == q["weights"]
                assert pool.slot_of(q["ref"]) == q["slot"]
                assert q["ref"] in pool.host_refs() or q["ref"] in {e[0] for e in residents.values()}
        demanded = {q["ref"] for q in live if pool.demand_of(q["ref"]) > 0}
        host_now = set(pool.host_refs())
        assert pinned & demanded <= host_now, "a host entry was evicted while a request still wants it"
        assert {ref for ref, _, _ in residents.values()} <= host_now, "a device resident without a host copy"
        pinned = (pinned & demanded) | (demanded & host_now)
        assert writer.slots == residents
    for q in live:  # abort everything: refcounts return to zero
        if q["running"]:
            pool.release_device(q["ref"])
        pool.undemand(q["ref"])
    snap = pool.snapshot()
    assert snap["total_demand"] == 0 and snap["total_device_refs"] == 0
    retired_left = [ref for ref in pool.host_refs() if ref != current[ref.name]]
    assert retired_left == [], "retired versions are freed after their last reader"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=40))
def test_host_lru_order(accesses):
    """Unreferenced host entries are evicted least recently used first."""
    pool, _, adapters = make_pool(max_loras=1, max_cpu_loras=3)
    refs = [new_ref(adapters, f"n{i}", 0, 4) for i in range(8)]
    model: list[AdapterRef] = []  # LRU order, oldest first
    for i in accesses:
        ref = refs[i]
        pool.demand(ref)
        pool.poll()
        pool.undemand(ref)
        if ref in model:
            model.remove(ref)
        model.append(ref)
        model = model[-3:]
        assert pool.host_refs() == model


def test_mixed_ranks_cost_their_own_rows_not_padding():
    pool, writer, adapters = make_pool(max_loras=4, max_cpu_loras=4, pool_rows=96)
    refs = [new_ref(adapters, f"n{i}", 0, r) for i, r in enumerate((8, 32, 8, 16))]
    for ref in refs:
        pool.demand(ref)
        assert pool.acquire_device(ref) is not None
    snap = pool.snapshot()
    assert snap["device_rows_used"] == 64
    assert snap["device_bytes_in_use"] == 640 and snap["device_bytes_if_padded"] == 4 * 32 * 10
    # Padded to max rank these four would need 128 rows and could not fit in 96.
    assert snap["device_bytes_capacity"] == 960


def test_referenced_slot_blocks_placement_and_reports_blockers():
    pool, _, adapters = make_pool(max_loras=2, max_cpu_loras=4, pool_rows=32)
    a, b, c = (new_ref(adapters, n, 0, 16) for n in "abc")
    for ref in (a, b, c):
        pool.demand(ref)
    assert pool.acquire_device(a) is not None and pool.acquire_device(b) is not None
    assert pool.acquire_device(c) is None  # both slots referenced: never evicted
    assert pool.device_blockers(c, [b, a]) == [b]
    pool.release_device(b)
    assert pool.acquire_device(c) is not None and pool.slot_of(b) is None and pool.slot_of(a) is not None


def test_host_tier_holds_every_device_resident():
    """Making host room drops an idle device resident from the device too, preferring entries
    that are not on the device; so a device copy is never the only copy of a version."""
    pool, writer, adapters = make_pool(max_loras=1, max_cpu_loras=2, pool_rows=32)
    a, b, c = (new_ref(adapters, n, 0, 8) for n in "abc")
    pool.demand(a)
    pool.acquire_device(a)
    pool.release_device(a)
    pool.undemand(a)  # a: idle on device and host
    assert pool.insert_host(b, adapters[b])  # room for b without touching a
    assert pool.insert_host(c, adapters[c])  # b (not on the device) goes first
    assert pool.host_refs() == [a, c] and pool.slot_of(a) == 0
    d = new_ref(adapters, "d", 0, 8)
    assert pool.insert_host(d, adapters[d])  # only idle device residents left... c is idle and not on device
    assert a in pool.host_refs() and pool.slot_of(a) == 0 and c not in pool.host_refs()
    e = new_ref(adapters, "e", 0, 8)
    pool.demand(d)  # d is wanted: the only idle entry is a, which leaves both tiers
    assert pool.insert_host(e, adapters[e])
    assert a not in pool.host_refs() and pool.slot_of(a) is None and writer.slots == {}


def test_retired_version_wanted_by_a_waiting_request_survives_an_in_place_update():
    """The reviewer's case: a request waits for version v1, the files are overwritten in place and
    v2 registered, and another adapter takes v1's only slot. v1 must still run from the host copy
    (a disk read would find v2's content and fail)."""
    stale: set[AdapterRef] = set()
    pool, writer, adapters = make_pool(max_loras=1, max_cpu_loras=2, pool_rows=32, stale=stale)
    v1, b = new_ref(adapters, "a", 1, 8), new_ref(adapters, "b", 0, 8)
    pool.insert_host(v1, adapters[v1])
    pool.demand(v1)
    pool.acquire_device(v1)
    pool.release_device(v1)
    pool.undemand(v1)  # v1 idle on device and host
    pool.insert_host(b, adapters[b])
    pool.demand(b)  # b waits
    assert pool.demand(v1) == "device"  # a request for v1 waits too
    v2 = new_ref(adapters, "a", 2, 8)
    stale.add(v1)  # v1's folder now holds v2's content
    pool.insert_host(v2, adapters[v2])  # host full of wanted entries: v2 is read again on demand
    pool.retire(v1)
    assert pool.acquire_device(b) == 0  # b takes the only slot; v1 leaves the device, not the host
    assert v1 in pool.host_refs() and pool.weights_ready(v1)
    pool.release_device(b)
    pool.undemand(b)
    assert pool.acquire_device(v1) == 0 and writer.slots[0][0] == v1 and pool.poll() == []
    pool.release_device(v1)
    pool.undemand(v1)  # its last reader: the retired version is freed
    assert v1 not in pool.host_refs() and pool.slot_of(v1) is None


def test_registering_again_into_a_full_host_tier_keeps_the_queued_read():
    """Re-registering a version whose disk read is queued, while every host entry is wanted, caches
    nothing; the queued read must stay, or its waiting request would never run."""
    pool, writer, adapters = make_pool(max_loras=1, max_cpu_loras=1, pool_rows=32)
    a, b = new_ref(adapters, "a", 0, 8), new_ref(adapters, "b", 0, 8)
    assert pool.insert_host(a, adapters[a])
    pool.demand(a)  # a: wanted, holds the only host entry
    assert pool.demand(b) == "disk" and pool.snapshot()["loads_queued"] == 1
    assert not pool.insert_host(b, adapters[b])  # no room: nothing cached
    assert pool.loads_pending and pool.snapshot()["loads_queued"] == 1
    pool.undemand(a)  # a's request ends: room for b's read
    pool.poll()
    assert pool.weights_ready(b) and pool.demand_of(b) == 1


def test_a_late_failed_read_of_a_version_already_in_place_fails_nobody():
    """A request's disk read is in flight; the same content is registered again from another
    folder (insert_host) and the request runs; the old folder is gone, so the read fails. That
    failure must not be reported: the weights the request runs on are in place."""
    gate = threading.Event()

    def loader(ref: AdapterRef) -> FakeAdapter:
        gate.wait(10)
        raise ValueError("/old/path: adapter folder does not exist")

    pool = AdapterPool(FakeWriter(), loader, max_loras=1, max_cpu_loras=2, pool_rows=32, max_lora_rank=32)
    try:
        x = AdapterRef("x", "v1")
        assert pool.demand(x) == "disk" and pool.snapshot()["loads_in_flight"] == 1
        assert pool.insert_host(x, FakeAdapter("x", "v1", 8))
        assert pool.acquire_device(x) == 0
        gate.set()
        pool.wait_for_load(10)
        assert pool.poll() == [] and x in pool.host_refs() and pool.device_refs_of(x) == 1
    finally:
        gate.set()
        pool.close()


def test_prefetch_replaces_unwanted_unreferenced_residents_only():
    pool, writer, adapters = make_pool(max_loras=2, max_cpu_loras=4, pool_rows=32)
    a, b, c = (new_ref(adapters, n, 0, 16) for n in "abc")
    for ref in (a, b):
        pool.demand(ref)
        pool.acquire_device(ref)
    pool.release_device(b)
    pool.undemand(b)  # a running, b resident but idle
    pool.demand(c)  # c waits on the host
    pool.prefetch([c])
    assert pool.slot_of(c) is not None and pool.slot_of(b) is None  # b made room; a (referenced) untouched
    assert pool.slot_of(a) is not None and pool.device_refs_of(c) == 0
    d = new_ref(adapters, "d", 0, 16)
    pool.demand(d)
    pool.prefetch([d, c])  # c is wanted too and a is referenced: no room for d
    assert pool.slot_of(d) is None and pool.slot_of(c) is not None


def test_reregistered_version_is_current_again_and_failed_retired_load_is_forgotten():
    pool, writer, adapters = make_pool()
    a = new_ref(adapters, "a", 0, 8)
    pool.demand(a)
    pool.retire(a)  # unregistered while a request reads it
    pool.revive(a)  # the same content registered again
    pool.undemand(a)  # last reader done: a is current, so it stays
    assert a in pool.host_refs()
    # A load in flight when its only request is aborted and its version retired, that then fails:
    # nobody is told (nobody waits), and the retired mark goes too.
    release = threading.Event()

    def failing_loader(ref: AdapterRef) -> FakeAdapter:
        release.wait(10)
        raise ValueError("the folder is gone")

    slow = AdapterPool(FakeWriter(), failing_loader, 1, 2, 32, max_lora_rank=32)
    gone = AdapterRef("gone", "v0")
    try:
        slow.demand(gone)
        slow.undemand(gone)
        slow.retire(gone)
        release.set()
        slow.wait_for_load(timeout=10)
        assert slow.poll() == [] and slow.snapshot()["loads_in_flight"] == 0
        assert gone not in slow._retired  # noqa: SLF001 - the mark would otherwise purge a later re-registration
    finally:
        slow.close()


def test_wanted_idle_residents_are_evicted_last_and_never_by_prefetch():
    """Z is idle on the device but a waiting request wants it; W is idle and unwanted. Placing X
    evicts W, not Z, and prefetch (optional work) never evicts Z."""
    pool, writer, adapters = make_pool(max_loras=2, max_cpu_loras=4, pool_rows=64)
    z, w, x, y = (new_ref(adapters, n, 1, 8) for n in "ZWXY")
    for ref in (z, w):
        pool.demand(ref)
        pool.acquire_device(ref)
        pool.release_device(ref)
        pool.undemand(ref)
    pool.insert_host(x, adapters[x])
    pool.insert_host(y, adapters[y])
    assert pool.demand(z) == "device"
    pool.demand(x)
    pool.acquire_device(x)
    assert pool.slot_of(w) is None and pool.slot_of(z) is not None and pool.counters["Z"].loads == 1  # read once
    pool.demand(y)
    pool.prefetch([y])  # the only idle resident is Z, which a request wants: prefetch leaves it
    assert pool.slot_of(z) is not None and pool.slot_of(y) is None


def test_retired_versions_are_counted_as_retired_not_as_evictions():
    """A hot update with room to spare pushes nothing out: the old version's removal is a
    retirement, counted once, when its last reader is done."""
    pool, writer, adapters = make_pool(max_loras=2, max_cpu_loras=4)
    v0 = new_ref(adapters, "a", 0, 8)
    pool.insert_host(v0, adapters[v0])
    pool.demand(v0)
    pool.acquire_device(v0)  # a running request reads v0
    v1 = new_ref(adapters, "a", 1, 8)
    pool.insert_host(v1, adapters[v1])
    pool.retire(v0)
    counters = pool.counters["a"]
    assert (counters.retired, counters.host_evictions, counters.device_evictions) == (0, 0, 0)  # still read
    pool.release_device(v0)
    pool.undemand(v0)
    assert v0 not in pool.host_refs() and pool.slot_of(v0) is None
    assert (counters.retired, counters.host_evictions, counters.device_evictions) == (1, 0, 0)
    pool.retire(v1)  # unregister: nobody reads it, dropped at once
    assert (counters.retired, counters.host_evictions, counters.device_evictions) == (2, 0, 0)


def test_a_read_waiting_for_a_host_tier_full_of_wanted_entries_drains_one():
    """Every host entry is wanted: the pool names one to drain (host_drain) and, once no sequence
    runs on it, evicts it for the queued read; its own waiting request then needs it read back."""
    pool, writer, adapters = make_pool(max_loras=1, max_cpu_loras=1, pool_rows=32)
    a, b = new_ref(adapters, "a", 0, 8), new_ref(adapters, "b", 0, 8)
    assert pool.insert_host(a, adapters[a])
    pool.demand(a)
    assert pool.acquire_device(a) is not None  # a request of a runs
    assert pool.host_drain() is None  # nothing waits for room yet
    assert pool.demand(b) == "disk" and pool.snapshot()["loads_queued"] == 1
    assert pool.host_drain() == a
    pool.demand(a)  # another request of a arrives and waits
    pool.poll()
    assert not pool.weights_ready(b)  # a still runs: nothing is evicted under it
    pool.release_device(a)  # a's running request ends; its second request still waits
    pool.undemand(a)
    pool.poll()
    assert pool.weights_ready(b) and not pool.weights_ready(a) and pool.demand_of(a) == 1
    assert pool.snapshot()["loads_queued"] == 1  # a's read waits now
    assert pool.host_drain() is None  # b has not run yet: draining it would evict it before it served anyone
    assert pool.acquire_device(b) is not None
    assert pool.host_drain() == b  # b runs: it is drained for a's read
    assert pool.counters["a"].host_evictions == 1


def test_the_host_drain_victim_is_the_running_entry_with_the_fewest_waiting_requests():
    """Of the running host entries, the one holding back the fewest waiting requests is drained,
    whatever the LRU order: draining the least recently demanded one took the adapter demanded
    first, in a backlog the most popular, and its waiting requests then waited for a second
    read behind every queued one (the 500-adapter sweep's most popular adapter started its last
    request at step 523 instead of 140)."""
    pool, writer, adapters = make_pool(max_loras=3, max_cpu_loras=3, pool_rows=32)
    popular, rare, middle = (new_ref(adapters, name, 0, 8) for name in ("popular", "rare", "middle"))
    for ref, waiting in ((popular, 3), (rare, 0), (middle, 1)):  # demanded in this order: popular is the LRU
        assert pool.insert_host(ref, adapters[ref])
        for _ in range(1 + waiting):
            pool.demand(ref)
        assert pool.acquire_device(ref) is not None  # one request of each runs
    late = new_ref(adapters, "late", 0, 8)
    assert pool.demand(late) == "disk"
    assert pool.host_drain() == rare  # nobody waits for it: it leaves when its one request ends
    pool.release_device(rare)
    pool.undemand(rare)
    pool.poll()
    assert pool.weights_ready(late) and not pool.weights_ready(rare)
    assert pool.counters["rare"].host_evictions == 1 and pool.snapshot()["loads_queued"] == 0  # no second read
    assert pool.weights_ready(popular) and pool.weights_ready(middle)
    second_late = new_ref(adapters, "second_late", 0, 8)
    pool.demand(second_late)
    assert pool.host_drain() == middle  # one waiting request against popular's three


def test_a_retired_version_is_never_the_host_drain_victim():
    pool, writer, adapters = make_pool(max_loras=1, max_cpu_loras=1, pool_rows=32)
    a, b = new_ref(adapters, "a", 0, 8), new_ref(adapters, "b", 0, 8)
    assert pool.insert_host(a, adapters[a])
    pool.demand(a)
    pool.retire(a)  # a hot update replaced it; its files may be gone
    pool.demand(b)
    assert pool.host_drain() is None
    pool.poll()
    assert pool.weights_ready(a) and not pool.weights_ready(b)


def test_no_room_is_forgotten_when_a_slot_frees_and_never_refuses_a_smaller_adapter():
    """The pool keeps a "no room" answer until its slots or references change: a request that
    finds no slot gets one as soon as a resident's last reader releases it, and an adapter with
    fewer rows than one that found no room is still placed where it fits."""
    pool, _, adapters = make_pool(max_loras=3, max_cpu_loras=6, pool_rows=48)
    big, small, rank8, rank16 = (new_ref(adapters, n, 0, r) for n, r in (("big", 32), ("small", 8), ("r8", 8), ("r16", 16)))
    for ref in (big, small, rank8, rank16):
        pool.demand(ref)
    pool.poll()
    assert pool.acquire_device(big) is not None and pool.acquire_device(small) is not None  # 40 of 48 rows
    assert pool.acquire_device(rank16) is None  # 8 rows left
    assert pool.acquire_device(rank16) is None  # the kept answer
    assert pool.acquire_device(rank8) is not None  # fewer rows than the refused one: placed
    assert pool.acquire_device(rank16) is None  # no slot left
    assert pool.device_blockers(rank16, [small, rank8, big]) == [small, rank8]  # 16 rows once both drain
    pool.release_device(small)  # its last reader: evictable now
    assert pool.acquire_device(rank16) is None  # 8 free rows after evicting it: still too few
    assert pool.device_blockers(rank16, [rank8, big]) == [rank8]
    pool.release_device(rank8)
    assert pool.acquire_device(rank16) is not None


def test_adapter_refs_pickled_into_another_process_hash_as_its_own():
    """AdapterRef keeps its hash; pickled (Ray) it is rebuilt, so a process with another string
    hash seed finds it in a dict keyed by refs it built itself."""
    import os
    import pickle
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent("""
        import pickle, sys
        from runtime.request import AdapterRef
        ref = pickle.loads(sys.stdin.buffer.read())
        print({AdapterRef("sql", "v1"): "found"}.get(ref, "missing"), hash(ref) == hash(AdapterRef("sql", "v1")))
    """)
    root = Path(__file__).resolve().parents[1]
    for seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", script], cwd=root, input=pickle.dumps(AdapterRef("sql", "v1")),
                              capture_output=True, timeout=60, env={**os.environ, "PYTHONHASHSEED": seed})
        assert done.returncode == 0, done.stderr.decode()
        assert done.stdout.decode().split() == ["found", "True"]


def _resident(pool, ref) -> None:
    """Demand ``ref`` and place it on the device, one running sequence on it."""
    pool.demand(ref)
    assert pool.acquire_device(ref) is not None


def test_only_the_running_residents_whose_rows_are_needed_are_drained():
    """Rows [0, 8), [8, 16) and [24, 32) running, [16, 24) free: a rank-16 adapter needs one of the
    two neighbours of the gap drained, not the first two in the scheduler's order."""
    pool, _, adapters = make_pool(max_loras=4, max_cpu_loras=6, pool_rows=32)
    first, second, gap, third, wide = (new_ref(adapters, n, 0, r) for n, r in (("first", 8), ("second", 8), ("gap", 8), ("third", 8), ("wide", 16)))
    for ref in (first, second, gap, third):
        _resident(pool, ref)
    pool.release_device(gap)
    pool.undemand(gap)
    pool.demand(wide)
    assert pool.acquire_device(wide) is None
    assert pool.device_blockers(wide, [first, second, third]) == [second]
    assert pool.device_blockers(wide, [first, third, second]) == [third]


def _fits(pool, rows: int, gone: set) -> bool:
    residents = pool.device_residents()
    if len(residents) == pool.max_loras and not any(ref in gone for ref, _, _ in residents.values()):
        return False
    used = sorted((start, start + n) for ref, start, n in residents.values() if ref not in gone)
    cursor = 0
    for a, b in used:
        if a - cursor >= rows:
            return True
        cursor = max(cursor, b)
    return pool.pool_rows - cursor >= rows


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.booleans()), min_size=1, max_size=40), st.sampled_from((4, 8, 16)))
def test_fragmented_rows_never_strand_an_adapter_and_drain_no_more_than_needed(operations, rank):
    """Mixed ranks placed and released in random order fragment the rows (nothing is moved). Yet an
    adapter on the host is never stranded: with every running resident offered for draining,
    ``device_blockers`` names a set (never None), and that set is minimal: each named resident's
    rows are needed (without any one of them the adapter does not fit). Draining them places it."""
    pool, _, adapters = make_pool(max_loras=4, max_cpu_loras=12, pool_rows=32)
    refs = [new_ref(adapters, f"a{i}", 0, r) for i, r in enumerate((4, 8, 16, 4, 8, 16, 8, 4))]
    for index, run in operations:
        ref = refs[index]
        if run:
            pool.demand(ref)
            if pool.acquire_device(ref) is None:
                pool.undemand(ref)
        elif pool.device_refs_of(ref) > 0:
            pool.release_device(ref)
            pool.undemand(ref)
    target = new_ref(adapters, "target", 0, rank)
    pool.demand(target)
    running = [ref for ref, _, _ in pool.device_residents().values() if pool.device_refs_of(ref) > 0]
    blockers = pool.device_blockers(target, running)
    assert blockers is not None
    idle = {ref for ref, _, _ in pool.device_residents().values() if pool.device_refs_of(ref) == 0}
    for victim in blockers:
        assert not _fits(pool, rank, idle | set(blockers) - {victim}), f"{victim} drained for nothing"
    for victim in blockers:
        while pool.device_refs_of(victim) > 0:
            pool.release_device(victim)
    assert pool.acquire_device(target) is not None
