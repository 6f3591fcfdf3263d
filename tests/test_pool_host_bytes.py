"""The host tier bounded by bytes (``max_cpu_lora_bytes``), alone or with the entry count: what
it evicts, what it never evicts, what it refuses. FakeAdapter takes 1000 bytes a rank."""
from __future__ import annotations

import pytest

from runtime.lora.pool import AdapterTooLarge
from tests.test_pool import FakeAdapter, make_pool, new_ref


def read_once(pool, ref) -> None:
    """A request for ``ref`` arrives, its read lands, the request ends: ``ref`` stays as an idle entry."""
    pool.demand(ref)
    pool.poll()
    pool.undemand(ref)


def register(pool, adapters, name: str, rank: int):
    """What the engine does at registration: the adapter read there is offered to the host tier
    (which learns its size whether or not it has room for it now)."""
    ref = new_ref(adapters, name, 0, rank)
    pool.insert_host(ref, adapters[ref])
    return ref


def test_idle_entries_leave_least_recently_used_first_until_the_bytes_fit():
    pool, _, adapters = make_pool(max_loras=1, max_cpu_loras=None, max_cpu_lora_bytes=40_000)
    a, b = register(pool, adapters, "a", 8), register(pool, adapters, "b", 16)
    assert pool.host_refs() == [a, b] and pool.snapshot()["host_bytes_in_use"] == 24_000
    c = register(pool, adapters, "c", 20)  # 44000 bytes: a (least recently used) goes, and then it fits
    assert pool.host_refs() == [b, c]
    d = register(pool, adapters, "d", 32)  # b alone is not room enough: c goes too
    assert pool.host_refs() == [d]
    snap = pool.snapshot()
    assert (snap["host_bytes_in_use"], snap["host_bytes_capacity"], snap["host_capacity"]) == (32_000, 40_000, None)
    assert [pool.counters[n].host_evictions for n in "abcd"] == [1, 1, 1, 0]


def test_bytes_alone_count_no_entries():
    pool, _, adapters = make_pool(max_loras=1, max_cpu_loras=None, max_cpu_lora_bytes=40_000)
    refs = [register(pool, adapters, f"n{i}", 4) for i in range(10)]
    assert pool.host_refs() == refs  # ten entries, 40000 bytes: the byte bound is the only one


def test_both_bounds_hold():
    pool, _, adapters = make_pool(max_loras=1, max_cpu_loras=2, max_cpu_lora_bytes=40_000)
    small = [register(pool, adapters, f"s{i}", 4) for i in range(3)]
    assert pool.host_refs() == small[1:]  # 12000 bytes would fit: the entry bound evicted the first
    big = register(pool, adapters, "big", 32)
    assert pool.host_refs() == [small[2], big]  # 4000 + 32000 fits; two entries


def test_a_demanded_entry_is_never_evicted_for_bytes_the_read_waits():
    pool, _, adapters = make_pool(max_loras=1, max_cpu_loras=None, max_cpu_lora_bytes=40_000)
    a = register(pool, adapters, "a", 32)
    pool.demand(a)
    b = register(pool, adapters, "b", 16)  # no room while a is demanded: registered, not cached
    assert pool.host_refs() == [a]
    assert pool.demand(b) == "disk"
    pool.poll()
    assert pool.host_refs() == [a] and pool.snapshot()["loads_queued"] == 1  # 32000 + 16000 > 40000
    pool.undemand(a)  # its last request ended: now it may go
    pool.poll()
    assert pool.host_refs() == [b]


def test_an_adapter_larger_than_the_whole_bound_is_refused_with_both_sizes():
    pool, _, adapters = make_pool(max_loras=1, max_cpu_loras=None, max_cpu_lora_bytes=40_000)
    small = register(pool, adapters, "small", 4)
    with pytest.raises(AdapterTooLarge) as err:
        pool.insert_host(new_ref(adapters, "huge", 0, 64), FakeAdapter("huge", "v0", 64))
    assert "'huge'" in str(err.value) and "64000 bytes" in str(err.value) and "40000 bytes" in str(err.value)
    assert "\n" not in str(err.value)
    assert pool.host_refs() == [small] and pool.snapshot()["host_bytes_in_use"] == 4_000  # nothing evicted for it


def test_a_read_of_a_version_never_seen_reserves_the_whole_bound_then_its_size():
    """A bare pool learns a version's size from its first read; until then the read holds the whole
    bound, so the bound holds whatever the read brings."""
    pool, _, adapters = make_pool(max_loras=1, max_cpu_loras=None, max_cpu_lora_bytes=40_000)
    a, b = new_ref(adapters, "a", 0, 4), new_ref(adapters, "b", 0, 4)
    pool.demand(a)
    pool.poll()
    pool.demand(b)  # unknown size: it would need all 40000 bytes, and a is demanded
    pool.poll()
    assert pool.host_refs() == [a] and pool.snapshot()["loads_queued"] == 1
    pool.undemand(a)
    pool.poll()
    assert pool.host_refs() == [b]
    read_once(pool, a)  # both sizes are known now: 8000 bytes, both stay
    pool.undemand(b)
    assert set(pool.host_refs()) == {a, b}


def test_drains_follow_one_another_until_a_large_read_fits():
    """Every entry runs and a rank-32 read waits: one drained rank-16 entry is not room enough, so it
    goes anyway (its waiting request reads it again later) and host_drain names the next one."""
    pool, _, adapters = make_pool(max_loras=2, max_cpu_loras=None, pool_rows=64, max_cpu_lora_bytes=40_000)
    a, b = register(pool, adapters, "a", 16), register(pool, adapters, "b", 16)
    for ref in (a, b):
        pool.demand(ref)  # one running request each, and one waiting
        pool.demand(ref)
        assert pool.acquire_device(ref) is not None
    c = register(pool, adapters, "c", 32)  # every entry demanded: not cached
    assert pool.host_refs() == [a, b]
    pool.demand(c)
    pool.poll()
    first = pool.host_drain()
    assert first in (a, b) and pool.snapshot()["loads_queued"] == 1
    pool.release_device(first)  # its running request ends; the waiting one stays
    pool.undemand(first)
    pool.poll()
    second = pool.host_drain()
    assert first not in pool.host_refs() and second in (a, b) and second != first
    assert c not in pool.host_refs()  # 16000 + 32000 > 40000: still waiting
    pool.release_device(second)
    pool.undemand(second)
    pool.poll()
    assert pool.host_refs() == [c] and pool.snapshot()["host_bytes_in_use"] == 32_000
    assert pool.snapshot()["loads_queued"] == 2  # a and b, for their waiting requests


def test_a_pool_needs_a_bound():
    with pytest.raises(ValueError, match="needs a bound"):
        make_pool(max_cpu_loras=None, max_cpu_lora_bytes=None)


def test_a_registration_that_cannot_fit_evicts_nothing():
    """Evicting idle entries one by one for a read that would still not fit drops them for nothing."""
    pool, _, adapters = make_pool(max_loras=1, max_cpu_loras=None, max_cpu_lora_bytes=40_000)
    idle, busy = register(pool, adapters, "idle", 8), register(pool, adapters, "busy", 24)
    pool.demand(busy)
    late = register(pool, adapters, "late", 20)  # 24000 + 20000 > 40000 even without the idle entry
    assert pool.host_refs() == [idle, busy] and late not in pool.host_refs()
    assert pool.counters["idle"].host_evictions == 0
