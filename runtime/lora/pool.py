"""Two-tier adapter pool: host LRU (``max_cpu_loras`` entries and/or ``max_cpu_lora_bytes``) + device slots (``max_loras``).

Stages: disk -> host (``loader``: read + validate, one at a time in a daemon thread of its own,
``runtime.file_reader``) -> device
(``writer.write_adapter(slot, adapter, row_start)`` on a copy stream, fenced by an
event before any kernel reads the slot).

Device rows. Every target slice has ``pool_rows`` rank-rows (``LoRASliceWeights``).
An adapter takes one contiguous range of ``adapter.max_rank`` rows, at the same start
in every slice, found first-fit over the gaps between resident ranges. So a rank-8
adapter costs 8 rows, not ``max_lora_rank``: device bytes in use are

    sum over resident adapters a of  max_rank(a) * row_bytes,
    row_bytes = sum over target slices of (in + out) * element size,

against ``len(resident) * max_lora_rank * row_bytes`` if every slot were padded.

Fragmentation. Rows are never moved (no compaction: a resident with running sequences is
pinned where it is, and moving an idle one costs the same copy as evicting it). So free rows
enough in total may lie in gaps each too small. A placement then evicts idle residents, least
recently used first, until it fits (every one up to there: that clears wide gaps), and if no
number of them is enough the scheduler drains running ones (``device_blockers``), only those
whose rows the gap needs (``_plan``). Since every resident can be drained and
``pool_rows >= max_lora_rank``, an adapter always fits once its blockers' sequences end:
fragmentation delays a placement, it never strands one.

References. Two counts per ``AdapterRef``:

- ``demand``: live requests (waiting or running) bound to the version. An entry with
  demand > 0 is never evicted from the host tier. A version that is retired (hot update
  replaced it, or its name was unregistered) is freed from both tiers when its demand
  falls to 0.
- ``device refs``: running sequences using the slot. A slot with refs > 0 is never
  evicted or overwritten. Unreferenced slots stay resident (a later request hits them)
  and are evicted least recently used first when rows or slots run out.

The host tier holds every device resident (host ⊇ device; ``max_cpu_loras >= max_loras``).
So a device copy is never the only copy: evicting it from the device never needs a disk
read, which matters for a retired version, whose files may already hold newer content (an
in-place update) or be gone. Host capacity counts resident entries plus loads in flight.

Host bytes. ``max_cpu_lora_bytes`` bounds the host tier's tensor bytes too (an adapter's ``nbytes``:
its A and B matrices), alone (``max_cpu_loras`` None) or with the entry count, both holding:

    sum over host entries e of nbytes(e)  +  sum over loads in flight l of reserved(l)  <=  max_cpu_lora_bytes

A load reserves its version's size, known since the version was inserted (at registration) or
read once (a version's content is fixed, so every read of it takes the same bytes); a version
never seen (only a bare pool reads those) reserves the whole bound. The totals change only when
an entry or a load comes or goes, never per step. An adapter larger than the whole bound can never
fit: ``check_fits_host`` refuses it before it is registered. With mixed sizes one eviction may not
make room: idle entries then go until it does, and the drained one (below) goes even when the room
is still short, so that ``host_drain`` names the next, until the read fits.
To make room the host evicts its least recently used entry that no request demands and no
running sequence references, preferring entries not on the device; an idle device resident
chosen this way leaves the device too. When every host entry is demanded, further loads
wait in FIFO order. So that they do not wait for ever behind adapters that never go idle
under steady traffic, ``host_drain`` then names one demanded entry (a current version with
running sequences and the fewest waiting requests, least recently used first on a tie, sticky
until the oldest queued read starts): the scheduler admits no new request of it, its running
sequences finish, and the read evicts it, although requests still wait for it; their adapter
is read again from disk, queued behind the reads already waiting.

A disk load that finishes after the same version reached the host some other way (the same
content registered again, from another folder) is dropped, success or failure: the weights
are in place, so a failed late read must not fail the requests that run on them.

Prefetch: after each step the engine passes the waiting requests' adapters; those on the
host are copied to the device ahead of the step that needs them, into free rows or in
place of unreferenced residents no waiting request wants (LRU first).
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from concurrent.futures import Future, wait, FIRST_COMPLETED
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from runtime.byte_size import format_byte_size
from runtime.file_reader import FileReader
from runtime.request import AdapterRef
from runtime.torch_threads import single_threaded_torch


class DeviceWriter(Protocol):
    def write_adapter(self, slot: int, adapter: Any, row_start: int) -> None: ...

    def clear_slot(self, slot: int) -> None: ...


Loader = Callable[[AdapterRef], Any]  # returns a LoRAAdapter with .max_rank; raises ValueError on bad input


@dataclass
class AdapterCounters:
    """Per-adapter-name pool counters (summed over versions)."""

    loads: int = 0  # disk -> host (the read at registration included)
    load_time_s: float = 0.0  # of the pool's own disk reads only (registration reads are not timed here)
    device_loads: int = 0  # host -> device
    host_evictions: int = 0  # dropped to make room (a retired version's removal is counted in retired instead)
    device_evictions: int = 0
    retired: int = 0  # versions dropped from the pool after a hot update or unregister, once no request needed them
    host_hits: int = 0  # request arrived with the adapter already on the host (not on device)
    device_hits: int = 0  # request arrived with the adapter already on the device
    disk_misses: int = 0  # request arrived with the adapter on disk only


@dataclass
class _DeviceEntry:
    ref: AdapterRef
    row_start: int
    rows: int


@dataclass
class _Load:
    future: Future  # of (adapter, seconds the loader took)
    reserved: int  # host bytes held for it until it lands (see the module docstring)


class AdapterTooLarge(ValueError):
    """An adapter takes more host memory than the whole host tier may hold (``max_cpu_lora_bytes``)."""


def adapter_nbytes(adapter: Any) -> int:
    """The host bytes an adapter takes: its ``nbytes`` (``LoRAAdapter``: its A and B matrices)."""
    return int(adapter.nbytes)


class CopyFence:
    """Orders adapter copies before the kernels that read them.

    On CUDA/NPU the copies go to a side stream and an event is recorded per slot; before
    a step, the compute stream waits on the events of the slots it will read. On CPU
    copies are synchronous, so there is nothing to wait for.
    """

    def __init__(self, device: torch.device) -> None:
        self._module = getattr(torch, device.type) if device.type in ("cuda", "npu") else None
        self._stream = self._module.Stream(device=device) if self._module is not None else None
        self._events: dict[int, Any] = {}

    def copy(self, slot: int, fn: Callable[[], None]) -> None:
        if self._module is None:
            fn()
            return
        # The side stream must not start before the compute stream is done with the slot's
        # previous occupant (eviction only happens to unreferenced slots, but an earlier
        # step may still be executing).
        self._stream.wait_stream(self._module.current_stream())
        with self._module.stream(self._stream):
            fn()
            event = self._module.Event()
            event.record(self._stream)
        self._events[slot] = event

    def wait(self, slots: Sequence[int]) -> None:
        if self._module is None:
            return
        current = self._module.current_stream()
        for slot in slots:
            event = self._events.pop(slot, None)
            if event is not None:
                current.wait_event(event)


@dataclass
class PoolFailure:
    ref: AdapterRef
    message: str


class AdapterPool:
    def __init__(
        self,
        writer: DeviceWriter,
        loader: Loader,
        max_loras: int,
        max_cpu_loras: Optional[int],
        pool_rows: int,
        max_lora_rank: int,
        row_bytes: int = 0,
        device: torch.device | str = "cpu",
        async_loads: bool = True,
        max_cpu_lora_bytes: Optional[int] = None,
    ) -> None:
        if max_cpu_loras is None and max_cpu_lora_bytes is None:
            raise ValueError("the host tier needs a bound: max_cpu_loras, max_cpu_lora_bytes or both")
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        if pool_rows < max_lora_rank:
            raise ValueError(f"pool_rows ({pool_rows}) cannot hold one adapter of max_lora_rank={max_lora_rank}")
        self.writer = writer
        self.loader = loader
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras  # None: entries are not counted, only bytes
        self.max_cpu_lora_bytes = max_cpu_lora_bytes  # None: bytes are not bounded, only entries
        self.pool_rows = pool_rows
        self.max_lora_rank = max_lora_rank
        self.row_bytes = row_bytes
        self._fence = CopyFence(torch.device(device))
        # Not a ThreadPoolExecutor: the interpreter joins those threads at exit, so a read stuck on a
        # hung mount held the process (and close()) for ever. See close().
        self._reader: Optional[FileReader] = FileReader("lorafleet-adapter-load", initializer=single_threaded_torch) if async_loads else None
        self._host: "OrderedDict[AdapterRef, Any]" = OrderedDict()  # LRU: oldest first
        self._host_bytes = 0  # sum of the host entries' sizes
        self._loading_bytes = 0  # sum of the loads in flight's reservations
        self._size_of: dict[AdapterRef, int] = {}  # every version inserted or read (until it is retired and gone)
        self._loading: dict[AdapterRef, _Load] = {}
        self._load_queue: deque[AdapterRef] = deque()
        self._demand: dict[AdapterRef, int] = {}
        self._retired: set[AdapterRef] = set()
        self._slots: list[Optional[_DeviceEntry]] = [None] * max_loras
        self._slot_of: dict[AdapterRef, int] = {}
        self._device_refs: dict[AdapterRef, int] = {}
        self._device_lru: "OrderedDict[AdapterRef, None]" = OrderedDict()  # oldest first
        self._failures: list[PoolFailure] = []
        self.counters: dict[str, AdapterCounters] = {}
        self._host_victim: Optional[AdapterRef] = None  # see host_drain
        # A step's admission loop asks for slots for many adapters that find none. Between two
        # changes to the slots or their references the answers cannot change, so they are kept:
        # the fewest rows that found no room, and device_blockers' answers (see _layout_changed).
        self._no_room_rows: Optional[int] = None
        self._blockers_memo: dict[tuple[int, tuple[AdapterRef, ...]], Optional[list[AdapterRef]]] = {}

    # ---- host tier ---------------------------------------------------------------------
    def check_fits_host(self, adapter: Any) -> None:
        """AdapterTooLarge when ``adapter`` alone takes more bytes than ``max_cpu_lora_bytes``: it
        could never be read into the host tier (every request for it would wait for ever)."""
        nbytes = adapter_nbytes(adapter)
        if self.max_cpu_lora_bytes is not None and nbytes > self.max_cpu_lora_bytes:
            raise AdapterTooLarge(
                f"adapter {adapter.name!r}: its weights take {format_byte_size(nbytes)} ({nbytes} bytes) of host memory, more than the whole "
                f"host tier may hold (max_cpu_lora_bytes {format_byte_size(self.max_cpu_lora_bytes)}, {self.max_cpu_lora_bytes} bytes); "
                "raise --max-cpu-lora-bytes or serve a smaller adapter"
            )

    def insert_host(self, ref: AdapterRef, adapter: Any) -> bool:
        """Cache an adapter loaded elsewhere (at registration); False if the host tier is full of demanded entries.
        AdapterTooLarge (nothing changed) when it can never fit (``check_fits_host``)."""
        self.check_fits_host(adapter)
        self._size_of[ref] = adapter_nbytes(adapter)
        if ref in self._host:
            self._host.move_to_end(ref)
            return True
        # Checked first: with mixed sizes, evicting idle entries one by one could drop some and still find no room.
        if not self._room_after_idle_leave(self._size_of[ref]) or not self._make_host_room(self._size_of[ref]):
            return False  # a queued disk read of it stays queued: its waiting requests still need one
        if ref in self._load_queue:  # a queued disk read of the same version is not needed any more
            self._load_queue.remove(ref)
        self._add_host(ref, adapter)
        self._counters(ref).loads += 1
        return True

    def demand(self, ref: AdapterRef) -> str:
        """A request binds to ``ref``. Returns where the adapter was: "device", "host" or "disk"."""
        counters = self._counters(ref)
        self._demand[ref] = self._demand.get(ref, 0) + 1
        if ref in self._slot_of:
            counters.device_hits += 1
            location = "device"
        elif ref in self._host:
            counters.host_hits += 1
            location = "host"
        else:
            counters.disk_misses += 1
            location = "disk"
        if ref in self._host:
            self._host.move_to_end(ref)
        else:  # the host holds every device resident, so it is on disk only
            self._queue_load(ref)
        self._start_loads()
        return location

    def undemand(self, ref: AdapterRef) -> None:
        """A request bound to ``ref`` finished or was aborted (including while its load is in flight)."""
        left = self._demand.get(ref, 0) - 1
        if left < 0:
            raise AssertionError(f"adapter {ref}: demand went negative")
        if left == 0:
            del self._demand[ref]
            if ref in self._load_queue:
                self._load_queue.remove(ref)
            if ref in self._retired:
                self._free_version(ref)
        else:
            self._demand[ref] = left

    def revive(self, ref: AdapterRef) -> None:
        """``ref`` is the current version of its name again (re-registered after a retire)."""
        self._retired.discard(ref)

    def retire(self, ref: AdapterRef) -> None:
        """``ref`` is no longer the current version of its name: free it after its last reader."""
        self._retired.add(ref)
        if self._demand.get(ref, 0) == 0:
            self._free_version(ref)

    def host_drain(self) -> Optional[AdapterRef]:
        """The demanded host entry that must stop taking new requests so the oldest queued disk
        read can start (see the module docstring), or None when no read waits for room.

        Sticky: the same entry until that read starts or the entry leaves the host, so its running
        sequences can finish. Only a current version with running sequences is chosen: a retired
        one may have no files left to read it back from (it leaves by itself once its demand ends),
        and one that has not run yet would leave before serving its waiting requests. None while
        no entry runs: the scheduler then starts one, and it can be chosen at the next step."""
        if not self._load_queue or self._host_has_idle_room():
            self._host_victim = None
            return None
        if self._host_victim is None or self._host_victim not in self._host or self._host_victim in self._retired:
            # Only an entry with running sequences: one whose requests all still wait (e.g. just read
            # for them) would be evicted before it served anyone, and the reads would take turns for ever.
            # Of those, the one with the fewest waiting requests (least recently demanded on a tie): it
            # holds back the fewest, and one with none leaves as soon as its running requests end,
            # with no second read. Taking the least recently demanded alone drained the adapter
            # demanded first, in a backlog the most popular one, whose many waiting requests then
            # waited for a second read behind every queued one.
            running = (r for r in self._host if r not in self._retired and self._device_refs.get(r, 0) > 0)
            self._host_victim = min(running, key=self._waiting_requests, default=None)
        return self._host_victim

    def _waiting_requests(self, ref: AdapterRef) -> int:
        """Requests bound to ``ref`` that do not run yet: its demand less its running sequences."""
        return max(0, self._demand.get(ref, 0) - self._device_refs.get(ref, 0))

    def weights_ready(self, ref: AdapterRef) -> bool:
        """The adapter's weights are in place to run (on the host, which holds every device resident)."""
        return ref in self._host or ref in self._slot_of

    def poll(self) -> list[PoolFailure]:
        """Collect finished loads, start queued ones; returns loads that failed since the last poll."""
        for ref, load in list(self._loading.items()):
            if load.future.done():
                self._finish_load(ref, load)
        self._start_loads()
        failures, self._failures = self._failures, []
        return failures

    def wait_for_load(self, timeout: Optional[float] = None) -> None:
        """Block until at least one in-flight load finishes (used when nothing else can run)."""
        futures = self.load_futures()
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def load_futures(self) -> list[Future]:
        """The in-flight loads (to wait on outside the engine lock)."""
        return [load.future for load in self._loading.values()]

    @property
    def loads_pending(self) -> bool:
        return bool(self._loading) or bool(self._load_queue)

    # ---- device tier ----------------------------------------------------------------------
    def slot_of(self, ref: AdapterRef) -> Optional[int]:
        return self._slot_of.get(ref)

    def acquire_device(self, ref: AdapterRef) -> Optional[int]:
        """Pin ``ref`` on the device for one running sequence; None if it cannot be placed now."""
        slot = self._slot_of.get(ref)
        if slot is None:
            if ref not in self._host:
                return None
            rows = self._host[ref].max_rank
            if self._no_room_rows is not None and rows >= self._no_room_rows:
                return None  # nothing changed since fewer rows found no room
            evictable = self._evictable()
            plan = self._plan(rows, evictable)
            if plan is None:
                # Fewer rows than any that found no room before (or the first): kept until the layout changes.
                every_slot_held = not evictable and all(e is not None for e in self._slots)
                self._no_room_rows = 1 if every_slot_held else rows  # 1: no adapter fits, whatever its rank
                return None
            evict, slot, row_start = plan
            for victim in evict:
                self._evict_device(victim)
            self._write(ref, slot, row_start)
        self._device_refs[ref] = self._device_refs.get(ref, 0) + 1
        self._layout_changed()
        self._device_lru.move_to_end(ref)
        return slot

    def release_device(self, ref: AdapterRef) -> None:
        left = self._device_refs.get(ref, 0) - 1
        if left < 0:
            raise AssertionError(f"adapter {ref}: device refs went negative")
        self._device_refs[ref] = left
        self._layout_changed()
        if left == 0 and ref in self._retired and self._demand.get(ref, 0) == 0:
            self._free_version(ref)

    def device_blockers(self, ref: AdapterRef, prefer: Sequence[AdapterRef]) -> Optional[list[AdapterRef]]:
        """Referenced resident adapters that must drain before ``ref`` fits (in ``prefer`` order).

        Unreferenced residents are assumed evicted first. None: ``ref`` cannot fit even
        after every adapter in ``prefer`` drains (or it is not on the host yet).
        """
        if ref in self._slot_of:
            return []  # already resident
        if ref not in self._host:
            return None
        memo_key = (self._host[ref].max_rank, tuple(prefer))
        if memo_key not in self._blockers_memo:
            referenced = [r for r in prefer if r in self._slot_of and self._device_refs.get(r, 0) > 0]
            plan = self._plan(memo_key[0], self._evictable() + referenced)
            self._blockers_memo[memo_key] = None if plan is None else [r for r in plan[0] if self._device_refs.get(r, 0) > 0]
        found = self._blockers_memo[memo_key]
        return None if found is None else list(found)

    def prefetch(self, refs: Sequence[AdapterRef]) -> None:
        """Copy host-ready adapters that the next steps want (``refs``, most wanted first) to the
        device ahead of need. Space comes from free rows first, then from evicting unreferenced
        residents that are not wanted, least recently used first; referenced slots are never touched."""
        wanted = set(refs)
        for ref in refs:
            if ref in self._slot_of or ref not in self._host:
                continue
            # Optional work: never evict an adapter that a request waits for.
            removable = [r for r in self._evictable() if r not in wanted and self._demand.get(r, 0) == 0]
            plan = self._plan(self._host[ref].max_rank, removable)
            if plan is None:
                return
            evict, slot, row_start = plan
            for victim in evict:
                self._evict_device(victim)
            self._write(ref, slot, row_start)
            self._device_refs.setdefault(ref, 0)

    def fence(self, slots: Sequence[int]) -> None:
        """Make the compute stream wait for the copies into ``slots``."""
        self._fence.wait(slots)

    # ---- reporting -----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        resident = [e for e in self._slots if e is not None]
        rows_used = sum(e.rows for e in resident)
        return {
            "device_slots_used": len(resident),
            "device_slots_total": self.max_loras,
            "device_rows_used": rows_used,
            "device_rows_total": self.pool_rows,
            "device_bytes_in_use": rows_used * self.row_bytes,
            "device_bytes_capacity": self.pool_rows * self.row_bytes,
            "device_bytes_if_padded": len(resident) * self.max_lora_rank * self.row_bytes,
            "host_entries": len(self._host),
            "host_capacity": self.max_cpu_loras,  # None: only bytes bound the host tier
            "host_bytes_in_use": self._host_bytes,
            "host_bytes_capacity": self.max_cpu_lora_bytes,  # None: only entries bound the host tier
            "loads_in_flight": len(self._loading),
            "loads_queued": len(self._load_queue),
            "total_demand": sum(self._demand.values()),
            "total_device_refs": sum(self._device_refs.values()),
        }

    def demand_of(self, ref: AdapterRef) -> int:
        return self._demand.get(ref, 0)

    def device_refs_of(self, ref: AdapterRef) -> int:
        return self._device_refs.get(ref, 0)

    def host_refs(self) -> list[AdapterRef]:
        return list(self._host)

    def device_residents(self) -> dict[int, tuple[AdapterRef, int, int]]:
        return {i: (e.ref, e.row_start, e.rows) for i, e in enumerate(self._slots) if e is not None}

    def stop_loads(self) -> None:
        """No new disk reads; those queued are cancelled (they will not run), the one running goes
        on (``load_futures`` still lists it). Idempotent. For a pool about to close: a read that
        would start afterwards is a RuntimeError, as a shut-down executor's submit."""
        if self._reader is None:
            return
        for load in self._loading.values():
            load.future.cancel()  # a queued read; the running one cannot be cancelled
        self._reader.shutdown()

    def close(self, timeout: Optional[float] = None) -> list[str]:
        """``stop_loads``, then wait for the read still running up to ``timeout`` s (None: until it
        ends). A read cannot be interrupted: one still going then (an adapter file on a hung network
        mount) is given up on: it goes on in the loader's daemon thread, which cannot hold the
        process's exit, and its outcome is dropped. Returns what was given up on, each as
        "adapter 'name' (version 0123456789ab) (running)"; [] when nothing was."""
        if self._reader is None:
            return []
        self.stop_loads()
        wait(self._reader.pending(), timeout=timeout)
        return self._reader.give_up(lambda what: RuntimeError(f"the adapter pool was closed before the read of {what} ended"))

    # ---- internals ----------------------------------------------------------------------
    def _counters(self, ref: AdapterRef) -> AdapterCounters:
        return self.counters.setdefault(ref.name, AdapterCounters())

    def _evictable(self) -> list[AdapterRef]:
        """Unreferenced device residents in eviction order: least recently used first, except that
        adapters waiting requests want go last (their requests would need them copied back)."""
        idle = [r for r in self._device_lru if self._device_refs.get(r, 0) == 0]
        return [r for r in idle if not self._demand.get(r, 0)] + [r for r in idle if self._demand.get(r, 0)]

    def _queue_load(self, ref: AdapterRef) -> None:
        if ref not in self._loading and ref not in self._load_queue:
            self._load_queue.append(ref)

    def _idle(self, ref: AdapterRef) -> bool:
        """No request wants ``ref`` and no sequence runs on it: the host may evict it."""
        return self._demand.get(ref, 0) == 0 and self._device_refs.get(ref, 0) == 0

    def _reservation(self, ref: AdapterRef) -> int:
        """Host bytes a read of ``ref`` holds until it lands: its known size, else the whole bound."""
        return self._size_of.get(ref, self.max_cpu_lora_bytes or 0)

    def _fits(self, nbytes: int, freed_entries: int = 0, freed_bytes: int = 0) -> bool:
        """One more entry of ``nbytes`` fits both bounds, once entries holding ``freed_entries`` and
        ``freed_bytes`` leave."""
        entries_fit = self.max_cpu_loras is None or len(self._host) + len(self._loading) - freed_entries < self.max_cpu_loras
        bytes_fit = self.max_cpu_lora_bytes is None or self._host_bytes + self._loading_bytes - freed_bytes + nbytes <= self.max_cpu_lora_bytes
        return entries_fit and bytes_fit

    def _host_has_idle_room(self) -> bool:
        """The oldest queued read fits once every idle entry leaves (``_make_host_room`` evicts them)."""
        return self._room_after_idle_leave(self._reservation(self._load_queue[0]))

    def _room_after_idle_leave(self, nbytes: int) -> bool:
        """One more entry of ``nbytes`` fits now or once every idle entry leaves."""
        if self._fits(nbytes):
            return True
        if self.max_cpu_lora_bytes is None:  # entries only: one idle entry is room
            return any(self._idle(r) for r in self._host)
        idle = [r for r in self._host if self._idle(r)]
        return bool(idle) and self._fits(nbytes, len(idle), sum(self._size_of[r] for r in idle))

    def _make_host_room(self, nbytes: int, evict_drained: bool = False) -> bool:
        """Evict idle host entries until one more entry of ``nbytes`` fits: least recently used first,
        entries not on the device before idle device residents (which then leave the device too, so
        the host keeps holding every device resident). ``evict_drained`` (a queued read starting):
        when no entry is idle, the ``host_drain`` victim goes once no sequence runs on it."""
        while not self._fits(nbytes):
            idle = [r for r in self._host if self._idle(r)]
            victim = next((r for r in idle if r not in self._slot_of), None) or next(iter(idle), None)
            if victim is None:
                drained = self._host_victim
                # A version retired after host_drain chose it is never drained: its folder may hold other content now.
                if (not evict_drained or drained is None or drained not in self._host or drained in self._retired
                        or self._device_refs.get(drained, 0) > 0):
                    return False
                self._evict_drained(drained)
                continue
            if victim in self._slot_of:
                self._evict_device(victim)
            self._evict_host(victim)
        return True

    def _evict_drained(self, ref: AdapterRef) -> None:
        """Drop the drained entry from both tiers although requests wait for it; they need it read again."""
        if ref in self._slot_of:
            self._evict_device(ref)
        self._drop_host(ref)
        self._counters(ref).host_evictions += 1
        self._host_victim = None
        self._queue_load(ref)  # behind the reads already waiting

    def _start_loads(self) -> None:
        while self._load_queue and self._make_host_room(self._reservation(self._load_queue[0]), evict_drained=True):
            ref = self._load_queue.popleft()
            if self._reader is None:
                future: Future = Future()
                try:
                    future.set_result(self._timed_load(ref))
                except Exception as err:  # recorded and reported to the requests bound to ref
                    future.set_exception(err)
            else:
                future = self._reader.submit(f"adapter {ref.name!r} (version {ref.version[:12]})", self._timed_load, ref)
            self._loading[ref] = _Load(future, self._reservation(ref))
            self._loading_bytes += self._loading[ref].reserved
            if self._reader is None:
                self._finish_load(ref, self._loading[ref])

    def _timed_load(self, ref: AdapterRef) -> tuple[Any, float]:
        """The loader and its own duration (read + validate), not the time queued before it ran."""
        started = time.perf_counter()
        adapter = self.loader(ref)
        return adapter, time.perf_counter() - started

    def _finish_load(self, ref: AdapterRef, load: _Load) -> None:
        del self._loading[ref]
        self._loading_bytes -= load.reserved
        counters = self._counters(ref)
        err = load.future.exception()
        if ref in self._host:  # registered again while this read ran: the weights are already in place
            return
        if err is not None:
            if self._demand.get(ref, 0) > 0:
                self._failures.append(PoolFailure(ref, f"loading adapter {ref.name!r} (version {ref.version[:12]}) failed: {err}"))
            elif ref in self._retired:
                self._free_version(ref)  # nobody waits for it: drop the retired mark too
            return
        adapter, seconds = load.future.result()
        counters.loads += 1
        counters.load_time_s += seconds
        if self._demand.get(ref, 0) == 0 and ref in self._retired:
            self._free_version(ref)  # aborted while loading and retired: nobody will read it
            return
        try:
            self.check_fits_host(adapter)  # a version never seen reserved the whole bound: this is the only way past it
        except AdapterTooLarge as err:
            if self._demand.get(ref, 0) > 0:
                self._failures.append(PoolFailure(ref, str(err)))
            return
        self._size_of[ref] = adapter_nbytes(adapter)
        self._add_host(ref, adapter)

    def _layout_changed(self) -> None:
        """The slots or their references changed: forget the answers kept since the last change.

        They depend on nothing else. Whether ``rows`` fit depends on which slots are taken and
        which residents have no reader; the eviction order among the readerless ones (least
        recently used, demanded last) decides which of them a placement evicts, never whether it
        fits or which residents with readers must drain first."""
        self._no_room_rows = None
        self._blockers_memo.clear()

    def _plan(self, rows: int, removable: Sequence[AdapterRef]) -> Optional[tuple[list[AdapterRef], int, int]]:
        """(adapters to evict, slot, row_start) to place ``rows`` rows, evicting part of ``removable``.

        The shortest prefix of ``removable`` after whose removal ``rows`` fit, less each resident
        with running sequences (``device_blockers`` offers them, after every idle one) that the
        placement does not need, tried last first so that the earlier, preferred ones are kept.
        Rows are never moved, so with fragmented rows a prefix can hold running residents whose
        rows do not touch the gap that is used: draining those held their requests back for
        nothing. Idle residents in the prefix all go: clearing the least recently used ones
        leaves wide gaps, where keeping those that the placement does not need left small ones
        scattered over the rows (in a random fuzz, one rank-32 adapter running at a time where
        two fit)."""
        for k in range(len(removable) + 1):
            if self._placement(rows, set(removable[:k])) is None:
                continue
            victims = list(removable[:k])
            for victim in reversed(removable[:k]):
                if self._device_refs.get(victim, 0) > 0 and self._placement(rows, set(victims) - {victim}) is not None:
                    victims.remove(victim)
            slot, start = self._placement(rows, set(victims))  # type: ignore[misc]  # fits: checked above
            return victims, slot, start
        return None

    def _placement(self, rows: int, gone: set[AdapterRef]) -> Optional[tuple[int, int]]:
        """(slot, row_start) for ``rows`` rows once the residents in ``gone`` leave: the first free slot
        and the first-fit gap; None when no slot or no gap is free."""
        free_slot = next((i for i, e in enumerate(self._slots) if e is None or e.ref in gone), None)
        if free_slot is None:
            return None
        entries = [e for e in self._slots if e is not None and e.ref not in gone]
        start = _first_fit(sorted((e.row_start, e.row_start + e.rows) for e in entries), rows, self.pool_rows)
        return None if start is None else (free_slot, start)

    def _write(self, ref: AdapterRef, slot: int, row_start: int) -> None:
        adapter = self._host[ref]
        self._fence.copy(slot, lambda: self.writer.write_adapter(slot, adapter, row_start))
        self._slots[slot] = _DeviceEntry(ref, row_start, adapter.max_rank)
        self._layout_changed()
        self._slot_of[ref] = slot
        self._device_lru[ref] = None
        self._host.move_to_end(ref)
        self._counters(ref).device_loads += 1

    def _evict_device(self, ref: AdapterRef, counted: bool = True) -> None:
        if self._device_refs.get(ref, 0) > 0:
            raise AssertionError(f"adapter {ref} is referenced by a running request and cannot be evicted")
        slot = self._slot_of.pop(ref)
        self._slots[slot] = None
        self._layout_changed()
        self._device_lru.pop(ref, None)
        self._device_refs.pop(ref, None)
        self.writer.clear_slot(slot)
        if counted:
            self._counters(ref).device_evictions += 1
        if self._demand.get(ref, 0) > 0 and ref not in self._host:
            self._queue_load(ref)  # its waiting requests need it back

    def _add_host(self, ref: AdapterRef, adapter: Any) -> None:
        self._host[ref] = adapter
        self._host_bytes += self._size_of[ref]

    def _drop_host(self, ref: AdapterRef) -> None:
        del self._host[ref]
        self._host_bytes -= self._size_of[ref]

    def _evict_host(self, ref: AdapterRef, counted: bool = True) -> None:
        if self._demand.get(ref, 0) > 0:
            raise AssertionError(f"adapter {ref} is demanded by a request and cannot be evicted from the host")
        self._drop_host(ref)
        if counted:
            self._counters(ref).host_evictions += 1

    def _free_version(self, ref: AdapterRef) -> None:
        """Drop a retired version with no readers from both tiers (not counted as evictions:
        nothing was pushed out for room; ``retired`` counts it once, when it is gone)."""
        if ref in self._slot_of and self._device_refs.get(ref, 0) == 0:
            self._evict_device(ref, counted=False)
        if ref in self._host:
            self._evict_host(ref, counted=False)
        if ref in self._load_queue:
            self._load_queue.remove(ref)
        if ref not in self._slot_of and ref not in self._loading and ref in self._retired:
            self._retired.discard(ref)
            self._size_of.pop(ref, None)  # gone for good: registering it again inserts it, with its size
            self._counters(ref).retired += 1


def _first_fit(used: Sequence[tuple[int, int]], rows: int, capacity: int) -> Optional[int]:
    """Lowest start of a gap of ``rows`` rows between the sorted used ranges [a, b)."""
    cursor = 0
    for a, b in used:
        if a - cursor >= rows:
            return cursor
        cursor = max(cursor, b)
    return cursor if capacity - cursor >= rows else None
