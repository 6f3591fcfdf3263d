"""Continuous batching with chunked prefill, a device-slot limit, and fairness across adapters.

Plain Python: no torch, no device code. Each ``schedule()`` builds one step under two
budgets, ``max_num_batched_tokens`` (C) and ``max_num_seqs``:

1. Running sequences, decodes first, then unfinished prefills, oldest first. A
   sequence gets ``min(tokens left to compute, budget left)`` tokens: long prompts are
   prefilled in chunks while decodes keep going. When the KV pool cannot hold a
   sequence's next chunk, the newest running sequence is preempted by recompute (its
   blocks are freed, its tokens kept; it goes back to the front of its adapter's queue
   and is prefilled again later). Nothing is ever dropped.
2. If nothing was preempted, waiting requests are admitted while budget, sequence and
   KV room remain. A request with an adapter must hold a device slot; the slots are
   ``max_loras``, so a step never has more than ``max_loras`` distinct adapters.

Fairness (virtual token counter, after Sheng et al., "Fairness in Serving Large
Language Models", OSDI'24, with a fair-share virtual time as in fair queueing). Each adapter
key (an ``AdapterRef``, or None for the base model) has a counter ``c`` of tokens it was served
(prefill and decode tokens, weight 1). A preempted sequence's recompute is not charged again, only
the tokens past those it had computed before: the victim is the newest running sequence, whatever
its adapter, and charging it twice put that adapter behind its share of the tokens it asked for.
Admission always picks the backlogged key with the smallest ``(c, arrival of its oldest waiting
request)``. The virtual time V advances after every step by that step's charged tokens over the
number of backlogged keys (each one's fair share), never falls below the smallest backlogged
counter m, and never passes s, the smallest counter among the keys served in the step:

    V <- max(V, min(max(V + tokens / |backlogged|, m), max(s, m)))

A key that becomes backlogged (no waiting or running request before) starts at
``c = max(c, V, m)``: idle time is never banked as credit, and service it had before counts
against it only until V catches up with it. Keys entering later enter at a later V, so a stream
of new adapters cannot overtake a key for ever. Why each part:
- entering at m alone, as VTC does, let a steady stream of new adapters pin m: an adapter served
  once, its counter above m, then never ran again while they kept coming (a soak of 2000
  adapters measured 8-16 s waits for it against under 1 s for one-off adapters);
- without the bound s, V ran ahead of adapters held back by device slots while the base model,
  which needs none, took the tokens they could not, and a new adapter entered behind them all
  (it never started; with V bounded by m plus one step's token budget instead, it waited ~740
  steps at the default budget). Keys that cannot run neither hold V back nor fall behind it.
  A key that runs but asks for little does hold it: while one long generation decodes alone
  (1 token a step), V moves about a token a step, and an adapter served before waits about as
  long as under VTC until it ends (a review measured 146 steps against VTC's 196 with 200-token
  prompts, 802 against 700 with 1000-token ones, and 21 without the long generation).
After every step, keys with no waiting or running request and ``c <= V`` are forgotten: on their
return they would start at V or more anyway, so no decision changes, and the counter table does
not grow with every adapter version ever served (each hot update is a new key). Offline work
(every request added before the first step) schedules exactly as under VTC. Fairness is per
adapter key, not per client: the clients of one adapter share its share.

If the chosen key X cannot get a device slot (every slot, or the rows it needs, are held by
running requests), the scheduler computes the resident adapters whose rows X needs
and stops admitting *new* requests of those adapters ("drain", sticky until X is placed, so
the victim cannot flip between adapters from step to step); their running requests finish
and free the slot, and X takes it when admission next reaches it. The victims stay drained, all
of them, until none of them runs. Meanwhile the keys after X in a step's order admit only
requests of adapters already running (and of the base model): a new placement, or a reference to
an idle resident, could take the rows a victim has just freed before the others free the rest X
needs (with X needing the rows of two victims, a stream of one-off adapters took each freed range
in turn, and X waited 1000 steps against a bound of 27; a victim done draining admitted again
and took its rows back, 67 steps against 22). Victims: adapters with no waiting request first, then the most served, then the one whose
running requests free its slot soonest (ties are never left to set order, which follows string hashes). Draining an
adapter that nobody waits for stops no admission (its slot frees as its requests end), while
draining one with a queue holds that queue back and makes it take a slot again later (on the
adapter-count sweep's 16-adapter workload, 52 steps instead of 56 for the same tokens); among
adapters with queues, the most served is held back, as the counters intend.

Bound (documented guarantee, tested in tests/test_scheduler.py and tests/test_engine.py).
Let S = max_num_seqs, C = max_num_batched_tokens (assume C >= S, so every decode fits in
a step), P the longest prompt and M the largest max_tokens in flight. While X waits for
a slot, no new request of a drained adapter starts. Each step, decodes take at most
S - 1 tokens, so prefills get at least C - S + 1 tokens, served oldest first; the drained
requests are older than anything admitted after the drain began, so their prefills are
done within ceil(S * P / (C - S + 1)) steps and their decodes within M more. Then the
slot is free and X, still first in that order, takes it. So once X's head is first in admission order,
it starts within

    ceil(S * P / (C - S + 1)) + M + 2 steps          (``Scheduler.fairness_bound_steps``)

provided its adapter is on the host and no KV-pressure preemption happens. A newly backlogged
X enters at V, which is at most the counter of a key served in the last step; what comes before
it in that order is ties with older heads, and keys below its counter (served less than their
fair share: each admission or decode charges them up to it). The formula covers only part of
that. Measured with random fuzzes (the two-adapter one is in tests/test_scheduler.py):
- steady traffic on two adapters with max_loras 2 and a third arriving: within the formula in
  600 of 600 runs;
- max_loras 1-3, closed-loop and deep-queue clients and base-model traffic: within it in 389 of
  400 (VTC: 397, but it starved returning adapters), the worst 1.9 times it, the mean wait 13.3
  steps against 10.6 (more than 5 steps longer than VTC's in 69 runs, shorter in 10);
- slot-bound adapters beside a base-model backlog at the default budget: 8-16 steps, the
  formula 43, whenever the new adapter arrives.

With S = 1 a tied older head takes the only sequence slot for a whole request first, so
the bound adds one request, ceil(P / C) + M steps (a random-schedule fuzz found waits of
up to that much with S = 1 and none over the plain bound with S >= 2).

Host tier: an adapter read from disk needs a host entry. When every entry is wanted by some
request, the pool names one of them (``host_drain``); it is drained like a device slot (no new
request of it starts), its running requests end, and the read takes its place. Its own waiting
requests then wait for it to be read back, behind the reads queued before.

Shared prompts in flight (prefix caching on): a head whose first prompt block the cache does
not hold is being computed by a running request (``n`` choices of one prompt, a burst of
requests with one system prompt) waits for that block to be published and then reuses it,
instead of computing it a second time in the same step. Every running prefill is done within
ceil(S * P / (C - S + 1)) steps (see above); with prefix caching the bound adds that much.
"""
from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Protocol, Sequence as Seq

from runtime.kv.block_manager import BlockManager
from runtime.request import AdapterRef, Sequence


class AdapterSlots(Protocol):
    """What the scheduler needs from the adapter pool (``runtime.lora.pool.AdapterPool``)."""

    def weights_ready(self, ref: AdapterRef) -> bool: ...

    def acquire_device(self, ref: AdapterRef) -> Optional[int]: ...

    def device_refs_of(self, ref: AdapterRef) -> int: ...

    def release_device(self, ref: AdapterRef) -> None: ...

    def device_blockers(self, ref: AdapterRef, prefer: Seq[AdapterRef]) -> Optional[list[AdapterRef]]: ...

    def host_drain(self) -> Optional[AdapterRef]: ...


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at ``seq.num_computed``; ``sample`` when they reach its end."""

    seq: Sequence
    num_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    drained: list[Optional[AdapterRef]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def adapters(self) -> set[AdapterRef]:
        return {c.seq.adapter for c in self.chunks if c.seq.adapter is not None}


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        pool: AdapterSlots,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int,
        prefix_seed: Optional[Callable[[Optional[AdapterRef]], Optional[bytes]]] = None,
    ) -> None:
        self.block_manager = block_manager
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self._prefix_seed = prefix_seed
        self.waiting: dict[Optional[AdapterRef], deque[Sequence]] = {}
        self.running: list[Sequence] = []  # sorted by arrival_index (oldest first)
        self.counters: dict[Optional[AdapterRef], float] = {}
        self._virtual_time = 0.0  # V: the fair-share clock a newly backlogged key starts at (module docstring)
        # Sticky drains: blocked adapter -> the residents it waits for. Kept across steps
        # so the victim does not flip between adapters (which would never free a slot).
        self._drains: dict[AdapterRef, list[AdapterRef]] = {}
        # Preempted sequences -> tokens they had computed: recomputing those is not charged (module docstring).
        self._recompute: dict[Sequence, int] = {}
        self.num_preemptions = 0  # preemptions by recompute since start (KV pressure; /metrics' lorafleet_preemptions_total)

    # ---- queue membership ------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        key = seq.adapter
        if not self._backlogged(key):
            active = [self.counters.get(k, 0.0) for k in self._backlogged_keys()]
            self.counters[key] = max(self.counters.get(key, 0.0), self._virtual_time, min(active, default=self._virtual_time))
        self.waiting.setdefault(key, deque()).append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out (finish or abort): frees its KV blocks and its device slot reference."""
        self._recompute.pop(seq, None)
        if seq in self.running:
            self.running.remove(seq)
            if seq.adapter is not None:
                self.pool.release_device(seq.adapter)
        else:
            queue = self.waiting.get(seq.adapter)
            if queue is not None and seq in queue:
                queue.remove(seq)
                if not queue:
                    del self.waiting[seq.adapter]
                    self._drains.pop(seq.adapter, None)
        self.block_manager.free(seq.request_id)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running) or any(self.waiting.values())

    def waiting_adapters(self, limit: int) -> list[AdapterRef]:
        """The first ``limit`` adapters of waiting requests in the order admission would consider
        them (for prefetch), without sorting every waiting adapter each step."""
        keys = [k for k, q in self.waiting.items() if q and k is not None]
        return heapq.nsmallest(limit, keys, key=lambda k: (self.counters.get(k, 0.0), self.waiting[k][0].arrival_index))

    def fairness_bound_steps(self, longest_prompt: int, max_tokens: int) -> int:
        """The documented admission bound (module docstring) for this scheduler's budgets."""
        s, c = self.max_num_seqs, self.max_num_batched_tokens
        if c < s:
            raise ValueError(f"the bound assumes max_num_batched_tokens ({c}) >= max_num_seqs ({s})")
        prefill = -(-s * longest_prompt // (c - s + 1))
        one_batch = prefill + max_tokens
        if s == 1:  # the one sequence slot first serves a tied older head: one more whole request
            one_batch += -(-longest_prompt // c) + max_tokens
        if self.block_manager.prefix_cache is not None:  # a head may wait for a shared prompt block in flight
            one_batch += prefill
        return one_batch + 2

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        planned: dict[Sequence, int] = {}
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        prefills = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            while not self.block_manager.ensure(seq.request_id, seq.num_computed + n):
                victim = self.running[-1]
                if victim in planned:
                    budget += planned.pop(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                planned[seq] = n
                budget -= n
        if not out.preempted:
            budget = self._admit(out, planned, budget)
        charged_tokens = 0
        for seq, n in planned.items():
            out.chunks.append(ScheduledChunk(seq, n, seq.num_computed + n == seq.num_tokens))
            charge = n
            if self._recompute and seq in self._recompute:
                charge = self._charge(seq, n)
                if self._recompute[seq] <= seq.num_computed + n:
                    del self._recompute[seq]  # its recompute is done with this chunk
            self.counters[seq.adapter] = self.counters.get(seq.adapter, 0.0) + charge
            charged_tokens += charge
        backlogged = self._backlogged_keys()
        self._advance_virtual_time(backlogged, charged_tokens, {seq.adapter for seq in planned})
        self._forget_idle_counters(backlogged)
        if len(out.adapters) > self.max_loras:
            raise AssertionError(f"step has {len(out.adapters)} adapters, more than max_loras={self.max_loras}")
        return out

    def _admit(self, out: SchedulerOutput, planned: dict[Sequence, int], budget: int) -> int:
        # Keys that may still admit in this step: a waiting queue and weights on the host. A key
        # leaves it when its queue empties, when it cannot get a slot, or when it is drained; nothing
        # in this loop can make another key ready (loads land in the pool's poll, before the step).
        # Built once: with hundreds of adapters waiting, rebuilding it per admission was ~10% of a step.
        ready = {k for k, q in self.waiting.items() if q and (k is None or self.pool.weights_ready(k))}
        host_victim = self.pool.host_drain()  # a host entry a queued disk read waits for: it takes no new request
        if host_victim is not None:
            ready.discard(host_victim)
            if self.waiting.get(host_victim):
                out.drained.append(host_victim)
        # The counter is charged for tokens planned in this step too, so two admissions in
        # one step already see each other's cost.
        planned_tokens: dict[Optional[AdapterRef], int] = {}
        for planned_seq, n in planned.items():
            planned_tokens[planned_seq.adapter] = planned_tokens.get(planned_seq.adapter, 0) + (self._charge(planned_seq, n) if self._recompute else n)

        def charged(k: Optional[AdapterRef]) -> float:
            return self.counters.get(k, 0.0) + planned_tokens.get(k, 0)

        # Ready keys by (charged, arrival of the head): a heap whose entries go stale when a key leaves
        # ``ready`` or is charged for an admission (it is pushed again then). Picking the minimum by a
        # scan made a step quadratic in the ready keys: with 2000 adapters on the host, 0.5 s a step.
        heap = [(charged(k), self.waiting[k][0].arrival_index, i, k) for i, k in enumerate(ready)]
        heapq.heapify(heap)
        pushes = len(heap)
        blocked = _SlotBlockers(self, charged)  # who holds the slots, computed once per change of the running set
        reserving = False  # a key ahead in this step's order waits for a drain: what its victims free is kept for it
        while budget > 0 and len(self.running) < self.max_num_seqs and heap:
            c, arrival, _, key = heapq.heappop(heap)
            if key not in ready or c != charged(key) or arrival != self.waiting[key][0].arrival_index:
                continue  # stale entry
            seq = self.waiting[key][0]
            seed = self._prefix_seed(key) if self._prefix_seed is not None else None
            # Prompt logprobs need every prompt position computed: such a request reuses no prefix (it still publishes its blocks).
            reuse = seq.params.prompt_logprobs is None
            if reuse and self.block_manager.prefix_in_flight(seq.request_id, seed, seq.all_token_ids):
                ready.discard(key)  # a running request is computing its next prompt block: reuse it once published
                continue
            if key is not None and reserving and self.pool.device_refs_of(key) == 0:
                # Only adapters already running may admit: a new placement, or a reference to an idle
                # resident, could take the rows a drain ahead of this key is freeing.
                ready.discard(key)
                continue
            if key is not None and self.pool.acquire_device(key) is None:
                ready.discard(key)
                # Sticky: the whole victim set is held back while any of it still runs (a victim done
                # draining would otherwise admit again and take back the rows it just freed).
                victims = self._drains.get(key, [])
                if not any(v in blocked.frees_in() for v in victims):
                    victims = self.pool.device_blockers(key, blocked.prefer()) or []
                self._drains[key] = victims
                reserving = reserving or bool(victims)
                for victim in victims:
                    ready.discard(victim)
                    if victim not in out.drained:
                        out.drained.append(victim)
                continue
            self._drains.pop(key, None)
            try:
                seq.num_computed = self.block_manager.acquire_prefix(seq.request_id, seed, seq.all_token_ids, reuse=reuse)
                n = min(seq.num_uncomputed, budget)
                fits = self.block_manager.ensure(seq.request_id, seq.num_computed + n)
                if fits:
                    if seq.preemptions == 0:  # a request's prompt is counted once: a readmission would count it again, hitting its own blocks
                        self.block_manager.count_prefix_lookup(seq.request_id)
                    self.waiting[key].popleft()
                    bisect.insort(self.running, seq, key=lambda s: s.arrival_index)
            except BaseException:
                # Interrupted (Ctrl-C while a long prompt is hashed) before it runs: a request that
                # is not running must hold no slot reference nor blocks, or its abort leaves them behind.
                if seq not in self.running:
                    self._unadmit(seq, key)
                raise
            if not fits:
                # Not enough KV for even its first chunk: stop admitting (first come first
                # served on memory, so a large request is not overtaken forever).
                self._unadmit(seq, key)
                break
            out.admitted.append(seq)
            planned[seq] = n
            planned_tokens[key] = planned_tokens.get(key, 0) + self._charge(seq, n)
            budget -= n
            blocked.changed()
            if self.waiting[key]:
                heapq.heappush(heap, (charged(key), self.waiting[key][0].arrival_index, pushes, key))
                pushes += 1
            else:
                del self.waiting[key]
                ready.discard(key)
        return budget

    def _unadmit(self, seq: Sequence, key: Optional[AdapterRef]) -> None:
        """Give back what an admission of ``seq`` took (blocks, its slot reference); it stays waiting, first."""
        self.block_manager.free(seq.request_id)
        seq.num_computed = 0
        if key is not None:
            self.pool.release_device(key)
        queue = self.waiting.setdefault(key, deque())
        if not queue or queue[0] is not seq:
            queue.appendleft(seq)

    def _advance_virtual_time(self, backlogged: set, tokens: int, served: set) -> None:
        """V <- max(V, min(max(V + tokens / |backlogged|, m), max(s, m))): each backlogged key's fair
        share of the step, never below the smallest backlogged counter m, and never past s, the
        smallest counter among the keys served in the step (module docstring)."""
        if backlogged:
            m = min(self.counters.get(k, 0.0) for k in backlogged)
            advanced = max(self._virtual_time + tokens / len(backlogged), m)
            least_served = min((self.counters.get(k, 0.0) for k in served), default=m)
            self._virtual_time = max(self._virtual_time, min(advanced, max(least_served, m)))

    def _forget_idle_counters(self, backlogged: set) -> None:
        """Drop idle keys at or below the virtual time: ``add`` would lift them to at least that."""
        if len(self.counters) > len(backlogged):
            for key in [k for k, c in self.counters.items() if c <= self._virtual_time and k not in backlogged]:
                del self.counters[key]

    def _charge(self, seq: Sequence, n: int) -> int:
        """What a chunk of ``n`` tokens from ``seq.num_computed`` costs ``seq``'s key: with ``r`` the tokens
        it had computed when it was preempted (none if it never was), ``max(0, num_computed + n - max(num_computed, r))``."""
        if not self._recompute:
            return n
        recomputed_until = self._recompute.get(seq, 0)
        return max(0, seq.num_computed + n - max(seq.num_computed, recomputed_until))

    def _preempt(self, seq: Sequence) -> None:
        self._recompute[seq] = max(self._recompute.get(seq, 0), seq.num_computed)
        self.running.remove(seq)
        self.block_manager.free(seq.request_id)
        if seq.adapter is not None:
            self.pool.release_device(seq.adapter)
        seq.num_computed = 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.setdefault(seq.adapter, deque()).appendleft(seq)

    def _backlogged(self, key: Hashable) -> bool:
        return bool(self.waiting.get(key)) or any(s.adapter == key for s in self.running)

    def _backlogged_keys(self) -> set:
        return {k for k, q in self.waiting.items() if q} | {s.adapter for s in self.running}


class _SlotBlockers:
    """What a key that finds no device slot in this step needs to know about the running requests,
    computed once and again only after an admission changes them (not once per such key: with
    hundreds of adapters waiting for a slot, most keys of a step find none).

    ``frees_in``: each resident adapter of a running request, in running order (oldest request
    first, not a set's order: ties in ``prefer`` must not depend on string hashing, which differs
    between processes), with at most how many more steps its running requests hold its slot.
    ``prefer``: the order in which to drain them: adapters with no waiting request first, then the
    most served (``charged``), then the one whose slot frees soonest.
    """

    def __init__(self, scheduler: "Scheduler", charged: Callable[[Optional[AdapterRef]], float]) -> None:
        self._scheduler = scheduler
        self._charged = charged
        self._frees_in: Optional[dict[AdapterRef, int]] = None
        self._prefer: Optional[list[AdapterRef]] = None

    def changed(self) -> None:
        self._frees_in = self._prefer = None

    def frees_in(self) -> dict[AdapterRef, int]:
        if self._frees_in is None:
            self._frees_in = {}
            for running in self._scheduler.running:
                if running.adapter is not None:
                    left = running.num_uncomputed + running.params.max_tokens - len(running.output_token_ids)
                    self._frees_in[running.adapter] = max(self._frees_in.get(running.adapter, 0), left)
        return self._frees_in

    def prefer(self) -> list[AdapterRef]:
        if self._prefer is None:
            frees_in, waiting = self.frees_in(), self._scheduler.waiting
            self._prefer = sorted(frees_in, key=lambda k: (bool(waiting.get(k)), -self._charged(k), frees_in[k]))
        return self._prefer
