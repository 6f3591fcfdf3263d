"""Scheduler in isolation (no model, no torch): budgets, chunking, preemption, fairness bound."""
from __future__ import annotations

import functools

from runtime.kv.block_manager import BlockManager
from runtime.request import AdapterRef, SamplingParams, Sequence
from runtime.scheduler import Scheduler
from tests.test_pool import FakeAdapter, FakeWriter
from runtime.lora.pool import AdapterPool


def _setup(num_blocks=64, max_loras=2, max_num_seqs=4, budget=8):
    adapters = {}
    pool = AdapterPool(FakeWriter(), lambda ref: adapters[ref], max_loras, 4, 64, 32, async_loads=False)
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(bm, pool, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_loras=max_loras)
    return sched, pool, adapters


def _seq(i, n_prompt, ref=None, max_tokens=3):
    return Sequence(f"s{i}", i, list(range(n_prompt)), SamplingParams(max_tokens=max_tokens), ref, 0.0)


def _run_step(sched, pool, observe=None):
    """Pretend the model ran: advance computed counts, 'sample' token 1, finish at max_tokens.
    ``observe()`` runs right after ``schedule()``, before finished requests leave."""
    out = sched.schedule()
    if observe is not None:
        observe()
    for c in out.chunks:
        c.seq.num_computed += c.num_tokens
        sched.block_manager.commit(c.seq.request_id, c.seq.all_token_ids, c.seq.num_computed)  # as the engine does (prefix cache)
        if c.sample:
            c.seq.output_token_ids.append(1)
            if len(c.seq.output_token_ids) >= c.seq.params.max_tokens:
                sched.remove(c.seq)
                if c.seq.adapter is not None:
                    pool.undemand(c.seq.adapter)
    return out


def _ref(adapters, pool, name, rank=8):
    ref = AdapterRef(name, "v")
    adapters[ref] = FakeAdapter(name, "v", rank)
    return ref


def test_budget_chunking_and_decode_first():
    sched, pool, _ = _setup(budget=8)
    sched.add(_seq(0, 3))
    sched.add(_seq(1, 20))
    out = _run_step(sched, pool)
    assert [(c.seq.request_id, c.num_tokens, c.sample) for c in out.chunks] == [("s0", 3, True), ("s1", 5, False)]
    assert out.num_tokens == 8  # s1's prompt is chunked to fill the budget
    out = _run_step(sched, pool)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("s0", 1), ("s1", 7)]  # decode first
    assert out.num_tokens == 8


def test_preempts_newest_when_kv_runs_out_and_never_drops():
    sched, pool, _ = _setup(num_blocks=4, budget=16)
    seqs = [_seq(i, 7, max_tokens=4) for i in range(3)]
    for s in seqs:
        sched.add(s)
    preempted = []
    for _ in range(60):
        if not sched.has_unfinished():
            break
        preempted += _run_step(sched, pool).preempted
    assert not sched.has_unfinished()
    assert all(len(s.output_token_ids) == 4 for s in seqs)
    assert preempted and all(p.arrival_index > 0 for p in preempted)  # the oldest is never the victim
    assert sched.block_manager.num_free_blocks == 4


def test_rare_adapter_admitted_within_documented_bound():
    sched, pool, adapters = _setup(max_loras=2, max_num_seqs=4, budget=8)
    a, b, c = (_ref(adapters, pool, n) for n in "abc")
    n = 0
    rare = None
    for step in range(200):
        for ref in (a, b):
            if sum(1 for s in sched.waiting.get(ref, ())) < 3:
                pool.demand(ref)
                pool.poll()
                sched.add(_seq(n, 6, ref))
                n += 1
        if step == 15:
            pool.demand(c)
            pool.poll()
            rare = _seq(10_000, 6, c)
            sched.add(rare)
            added = step
        out = _run_step(sched, pool)
        assert len(out.adapters) <= 2
        if rare is not None and rare.num_computed > 0:
            waited = step - added
            break
    assert rare is not None and rare.num_computed > 0, "starved"
    assert waited <= sched.fairness_bound_steps(6, 3)


def _add(sched, pool, seq):
    pool.demand(seq.adapter)  # one demand per request, as the engine does
    pool.poll()
    sched.add(seq)


def _steps_until_started(sched, pool, seq, limit):
    """Run steps until ``seq`` starts, at most ``limit``: every step's output, the one it started in last."""
    outs = []
    while len(outs) < limit:
        outs.append(_run_step(sched, pool))
        if seq.num_computed:
            return outs
    raise AssertionError(f"{seq.request_id} did not start within {limit} steps")


def _admitted_adapters(outs):
    return [s.adapter for out in outs for s in out.admitted]


def _two_residents(max_num_seqs, b_max_tokens, b_prompt):
    """Two slots held by running requests of a (20-token prompt, so more served) and b; c known.
    A key arriving now starts at the virtual time, which here is b's counter (the least served of
    the keys that ran): tied with b, c comes first against b's later requests (older head)."""
    sched, pool, adapters = _setup(max_loras=2, max_num_seqs=max_num_seqs, budget=64)
    refs = a, b, _ = tuple(_ref(adapters, pool, n) for n in "abc")
    add = functools.partial(_add, sched, pool)
    add(_seq(0, 20, a, max_tokens=6))
    add(_seq(1, b_prompt, b, max_tokens=b_max_tokens))
    _run_step(sched, pool)
    assert sched.counters[a] > sched.counters[b] == sched._virtual_time
    return sched, pool, add, refs


def test_drain_takes_the_slot_nobody_waits_for():
    """Both slots busy, c blocked: a (most served, more requests waiting) and b (nothing
    waiting) could each free a slot. Draining b costs no admission, so b is drained and
    a's waiting requests still start. The drain is sticky: a request of b arriving while c
    waits is held back too, and c takes b's slot in the step after b's running request ends."""
    sched, pool, add, (a, b, c) = _two_residents(max_num_seqs=8, b_max_tokens=4, b_prompt=2)
    more_a = [_seq(2, 3, a), _seq(3, 3, a)]
    rare = _seq(4, 3, c)
    for seq in (rare, *more_a):
        add(seq)
    out = _run_step(sched, pool)
    assert out.drained == [b]
    assert set(out.admitted) == set(more_a)
    late_b = _seq(5, 3, b)
    add(late_b)  # b holds a slot, so only the drain keeps this one out
    bound = sched.fairness_bound_steps(longest_prompt=20, max_tokens=6)
    outs = _steps_until_started(sched, pool, rare, bound - 1)
    # b's running request (4 tokens, the first in the setup step) samples its last in the second
    # step after the drain began; c starts in the third.
    assert _admitted_adapters(outs[:-1]) == [], "a drained adapter's request started while c waited"
    assert all(out.drained == [b] for out in outs[:-1])
    assert len(outs) == 3
    assert outs[-1].admitted[0] is rare and late_b.num_computed == 0


def test_drain_holds_back_the_most_served_when_every_resident_has_a_queue():
    """Both residents have waiting requests (a more served, with the longer queue): the most
    served is drained, as the counters intend, not the one with the shorter queue."""
    sched, pool, add, (a, b, c) = _two_residents(max_num_seqs=3, b_max_tokens=6, b_prompt=19)
    rare = _seq(2, 3, c)
    add(rare)
    for i in (3, 4):
        add(_seq(i, 3, a))
    add(_seq(5, 3, b))
    outs = _steps_until_started(sched, pool, rare, sched.fairness_bound_steps(longest_prompt=20, max_tokens=6))
    assert outs[0].drained == [a]
    assert [s.adapter for s in outs[0].admitted] == [b]
    # a's and b's first requests (6 tokens each, the first in the setup step) sample their last
    # in the fifth step here; b's second ends in the third and frees a sequence slot that a's
    # queue must not take while c waits. c starts in the sixth step.
    assert a not in _admitted_adapters(outs[:-1]), "the drained adapter's queue was admitted while c waited"
    assert len(outs) == 6
    assert outs[-1].admitted[0] is rare


def _rare_adapter_wait(seed: int, prefix_cache: bool = False) -> tuple[int, int, tuple]:
    """Random budgets, prompt and output lengths, steady traffic on adapters a and b with
    max_loras=2, and one request of adapter c arriving at a random step: (waited, bound, config).
    ``prefix_cache``: with the prefix cache on; every prompt is a prefix of one sequence, so the
    requests of a and b keep finding each other's blocks in flight and waiting for them."""
    import random

    from runtime.kv.prefix_cache import PrefixCache

    rng = random.Random(seed)
    s = rng.randint(1, 6)
    c, p, m = rng.randint(s, 3 * s + 8), rng.randint(1, 12) + (12 if prefix_cache else 0), rng.randint(1, 6)
    adapters: dict = {}
    pool = AdapterPool(FakeWriter(), lambda r: adapters[r], 2, 4, 64, 32, async_loads=False)
    cache = PrefixCache("base") if prefix_cache else None
    sched = Scheduler(BlockManager(4096, 4, cache), pool, max_num_seqs=s, max_num_batched_tokens=c, max_loras=2,
                      prefix_seed=cache.seed if cache is not None else None)  # fmt: skip
    refs = {n: AdapterRef(n, "v") for n in "abc"}
    for n, ref in refs.items():
        adapters[ref] = FakeAdapter(n, "v", rng.choice([8, 16, 32]))
    add_at, queue, idx, rare = rng.randint(0, 30), rng.randint(1, 6), 0, None
    for step in range(2000):
        for n in "ab":
            while len(sched.waiting.get(refs[n], ())) < queue:
                pool.demand(refs[n])
                sched.add(Sequence(f"s{idx}", idx, list(range(rng.randint(1, p))), SamplingParams(max_tokens=rng.randint(1, m)), refs[n], 0.0))
                idx += 1
        if step == add_at:
            prompt = list(range(rng.randint(1, p)))
            pool.demand(refs["c"])
            rare = Sequence("rare", idx, prompt, SamplingParams(max_tokens=m), refs["c"], 0.0)
            idx += 1
            sched.add(rare)
        _run_step(sched, pool)
        if rare is not None and (rare.num_computed > 0 or rare.output_token_ids):
            return step - add_at, sched.fairness_bound_steps(p, m), (s, c, p, m)
    return 10**9, sched.fairness_bound_steps(p, m), (s, c, p, m)


def test_documented_bound_holds_on_random_budgets():
    """The fairness bound, including max_num_seqs=1 (where a tied older head takes the only
    sequence slot first), over random budgets, lengths and arrival times."""
    over = [(seed, *_rare_adapter_wait(seed)) for seed in range(600)]
    over = [o for o in over if o[1] > o[2]]
    assert over == [], over[:5]


def test_documented_bound_holds_with_prefix_caching_and_shared_prompts_in_flight():
    """The same fuzz with the prefix cache on and prompts that share prefixes, so heads keep
    waiting for blocks in flight; the bound then adds one prefill (``fairness_bound_steps``)."""
    waits = [(seed, *_rare_adapter_wait(seed, prefix_cache=True)) for seed in range(600)]
    assert [w for w in waits if w[1] > w[2]] == [], [w for w in waits if w[1] > w[2]][:5]


class _RememberingScheduler(Scheduler):
    """The scheduler without forgetting idle counters: the reference for the test below."""

    def _forget_idle_counters(self, backlogged: set) -> None:
        return None


def _traffic_setup(seed: int, sched_cls=Scheduler, pool_cls=AdapterPool, max_cpu_loras: int = 8, max_num_seqs: int = 4, budget: int = 12):
    """(rng, adapters, pool, scheduler) for the random traffics below: 3 slots of 64 rows."""
    import random

    adapters: dict = {}
    pool = pool_cls(FakeWriter(), lambda r: adapters[r], 3, max_cpu_loras, 64, 32, async_loads=False)
    sched = sched_cls(BlockManager(4096, 4), pool, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_loras=3)
    return random.Random(seed), adapters, pool, sched


def _random_traffic(sched_cls, seed: int):
    """A base-model backlog plus random adapter requests over many hot-update versions, with
    idle spells (the backlog empties); returns every step's (request id, tokens) plan and the scheduler."""
    rng, adapters, pool, sched = _traffic_setup(seed, sched_cls)
    plans, idx = [], 0
    for step in range(400):
        if step % 100 >= 80:  # the last 20 of every 100 steps: no new requests, the engine drains and idles
            plans.append([(c.seq.request_id, c.num_tokens) for c in _run_step(sched, pool).chunks])
            continue
        if len(sched.waiting.get(None, ())) < 2:  # otherwise a base-model backlog
            sched.add(Sequence(f"b{idx}", idx, list(range(rng.randint(1, 9))), SamplingParams(max_tokens=rng.randint(1, 4)), None, 0.0))
            idx += 1
        if rng.random() < 0.4:
            ref = AdapterRef(f"a{rng.randrange(3)}", f"v{step // 7}")  # a new version every 7 steps
            adapters.setdefault(ref, FakeAdapter(ref.name, ref.version, rng.choice([8, 16])))
            pool.demand(ref)
            pool.poll()
            sched.add(Sequence(f"r{idx}", idx, list(range(rng.randint(1, 9))), SamplingParams(max_tokens=rng.randint(1, 5)), ref, 0.0))
            idx += 1
        plans.append([(c.seq.request_id, c.num_tokens) for c in _run_step(sched, pool).chunks])
    return plans, sched


def test_forgetting_idle_counters_bounds_the_table_and_changes_no_decision():
    """Also across idle spells: a key returning to an empty scheduler is lifted to the virtual time."""
    for seed in range(5):
        forgetful, sched = _random_traffic(Scheduler, seed)
        remembering, ref_sched = _random_traffic(_RememberingScheduler, seed)
        assert forgetful == remembering, f"seed {seed}: forgetting idle counters changed a schedule"
        backlogged = len(sched._backlogged_keys())
        assert len(sched.counters) <= backlogged + 3, (len(sched.counters), backlogged)
        assert len(ref_sched.counters) > 60  # over a hundred keys were served: without forgetting, one counter each


class _CountingPool(AdapterPool):
    """Counts placement searches (``_plan``), the work a slot request costs the pool."""

    plans = 0

    def _plan(self, rows, removable):
        type(self).plans += 1
        return super()._plan(rows, removable)


class _AnswerEveryTimePool(_CountingPool):
    """The pool without its kept answers: every slot request searches again (the reference below)."""

    plans = 0

    def acquire_device(self, ref):
        self._layout_changed()
        return super().acquire_device(ref)

    def device_blockers(self, ref, prefer):
        self._layout_changed()
        return super().device_blockers(ref, prefer)


def _slot_contention_traffic(pool_cls, seed: int):
    """Requests of 20 adapters of ranks 8-32 (and some base-model ones) for 3 slots of 64 rows,
    arriving faster than they finish: most steps, several adapters find no slot. Returns every
    step's (planned chunks, drained adapters)."""
    rng, adapters, pool, sched = _traffic_setup(seed, pool_cls=pool_cls, max_cpu_loras=24, max_num_seqs=8, budget=24)
    steps, idx = [], 0
    for step in range(300):
        for _ in range(rng.randrange(4) if step < 240 else 0):
            ref = None if rng.random() < 0.15 else AdapterRef(f"a{rng.randrange(20)}", "v")
            if ref is not None:
                adapters.setdefault(ref, FakeAdapter(ref.name, ref.version, rng.choice([8, 16, 32])))
                pool.demand(ref)
                pool.poll()
            sched.add(Sequence(f"r{idx}", idx, list(range(rng.randint(1, 9))), SamplingParams(max_tokens=rng.randint(1, 6)), ref, 0.0))
            idx += 1
        out = _run_step(sched, pool)
        steps.append(([(c.seq.request_id, c.num_tokens) for c in out.chunks], [str(r) for r in out.drained]))
    assert not sched.has_unfinished()
    return steps


def test_kept_slot_answers_change_no_decision():
    """The pool keeps "no room" and ``device_blockers`` answers until its slots or references
    change; under slot contention every schedule matches a pool that searches again for every
    request, with fewer searches."""
    _CountingPool.plans = _AnswerEveryTimePool.plans = 0
    for seed in range(5):
        kept = _slot_contention_traffic(_CountingPool, seed)
        searched = _slot_contention_traffic(_AnswerEveryTimePool, seed)
        assert kept == searched, f"seed {seed}: a kept answer changed a schedule"
        assert sum(1 for _, drained in kept if drained) > 50  # contention: many steps drain a slot
    assert _CountingPool.plans < _AnswerEveryTimePool.plans, (_CountingPool.plans, _AnswerEveryTimePool.plans)


def test_a_step_with_hundreds_of_adapters_waiting_for_slots_searches_them_a_few_times():
    """200 adapters on the host each wait with one request while both slots are held: one step
    used to search the slots once or twice for each of them (and scan every ready adapter for each
    admission), 0.5 s a step with 2000 adapters; now the answer is kept until the slots change."""
    adapters: dict = {}
    pool = _CountingPool(FakeWriter(), lambda r: adapters[r], 2, 256, 64, 32, async_loads=False)
    sched = Scheduler(BlockManager(4096, 4), pool, max_num_seqs=8, max_num_batched_tokens=64, max_loras=2)
    refs = [_ref(adapters, pool, f"a{i}", rank=16) for i in range(202)]
    for i, ref in enumerate(refs):
        pool.demand(ref)
        pool.poll()
        sched.add(_seq(i, 4, ref, max_tokens=50))
    _run_step(sched, pool)  # the first two adapters take both slots
    assert len(sched.running) == 2
    _CountingPool.plans = 0
    out = _run_step(sched, pool)
    assert not out.admitted and len(sched.waiting) == 200  # nobody got a slot
    assert out.drained  # the adapters that wait still ask for the held slots
    assert _CountingPool.plans <= 4, _CountingPool.plans


def test_fairness_bound_is_the_documented_formula():
    """The tests above compare waits with ``fairness_bound_steps``; pin that method to the
    formula in the module docstring, computed here independently."""
    import math

    import pytest

    sched, _, _ = _setup()
    for s, c, p, m in [(4, 8, 6, 3), (8, 8, 6, 4), (32, 512, 100, 32), (1, 1, 7, 5), (1, 16, 40, 9), (3, 20, 1, 1)]:
        sched.max_num_seqs, sched.max_num_batched_tokens = s, c
        want = math.ceil(s * p / (c - s + 1)) + m + 2 + ((math.ceil(p / c) + m) if s == 1 else 0)
        assert sched.fairness_bound_steps(p, m) == want, (s, c, p, m)
    sched.max_num_seqs, sched.max_num_batched_tokens = 8, 4
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.fairness_bound_steps(6, 3)


def test_no_credit_across_an_idle_engine():
    """A and B are served while both are backlogged, then the engine idles. A key arriving at
    the idle engine (new, or returning after it was forgotten) starts at exactly the virtual
    time, which is at least every backlogged minimum seen: not left at 0 (it would then win every
    admission against a key that kept its counter, until it had caught up), nor lifted to the
    largest counter kept (A's, which ends above the virtual time). A, returning, keeps its own."""
    sched, pool, adapters = _setup(max_loras=2, max_num_seqs=4, budget=8)
    a, b, c = (_ref(adapters, pool, n) for n in "abc")
    for i in range(40):
        pool.demand(a if i % 2 else b)
        pool.poll()
        sched.add(_seq(i, 6, a if i % 2 else b))
    pool.demand(a)
    pool.poll()
    sched.add(_seq(40, 12, a, max_tokens=1))  # A's last request: a long prefill, so A ends well above B
    minima = []

    def observe():  # the backlogged minimum as each step leaves it: charged, finished requests not yet gone
        backlogged = sched._backlogged_keys()
        if backlogged:
            minima.append(min(sched.counters[k] for k in backlogged))

    while sched.has_unfinished():
        _run_step(sched, pool, observe)
    for _ in range(3):  # idle steps
        _run_step(sched, pool, observe)
    virtual_time = sched._virtual_time
    assert virtual_time >= max(minima) > 100  # both were served hundreds of tokens
    assert b not in sched.counters and sched.counters[a] > virtual_time  # B forgotten, A remembered above the virtual time
    a_counter = sched.counters[a]
    for ref, i in ((c, 100), (b, 101), (a, 102)):  # new C first, then B (forgotten by now) and A return
        pool.demand(ref)
        pool.poll()
        sched.add(_seq(i, 6, ref))
    assert sched.counters[c] == sched.counters[b] == virtual_time
    assert sched.counters[a] == a_counter


def test_schedule_does_not_depend_on_string_hashing(tmp_path) -> None:
    """Drain victims tied on (waiting, served) were ordered by iterating a set of adapter refs,
    whose order follows string hashes, which differ per process (PYTHONHASHSEED): the same
    16-adapter workload took 52 steps in some processes and 56 in others. Ties now go to the
    adapter whose requests free its slot soonest, in running order: the same steps everywhere,
    and the smaller count (52)."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(f"""
        import dataclasses, sys
        from pathlib import Path
        from runtime.bench.workload import WorkloadSpec, generate
        from runtime.bench.suite import BenchSetup, prepare, engine_config, workload_jobs, stepped_in_turn
        from runtime.bench.synthetic import LlamaShape
        spec = WorkloadSpec(num_requests=48, num_adapters=16, alpha=1.0, input_len=(8, 16), output_len=(16, 32), ranks=(8, 16))
        setup = BenchSetup(Path({str(tmp_path)!r}), LlamaShape.sized(64, 1), max_loras=8, max_num_seqs=32, max_num_batched_tokens=1024)
        w = generate(spec)
        w = dataclasses.replace(w, requests=tuple(dataclasses.replace(r, arrival_s=0.0) for r in w.requests))
        model, adapters = prepare(w, setup)
        print(stepped_in_turn({{"run": (engine_config(setup, model), *workload_jobs(w, adapters))}})["run"]["steps"])
    """)
    root = Path(__file__).resolve().parents[1]
    steps = set()
    for seed in ("1", "2", "4"):  # 2 and 4 gave 56 before, 1 gave 52
        done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300,
                              env={**__import__("os").environ, "PYTHONHASHSEED": seed})
        assert done.returncode == 0, done.stderr
        steps.add(int(done.stdout.split()[-1]))
    assert steps == {52}


def test_an_adapter_served_before_is_not_starved_by_a_stream_of_new_adapters():
    """Twelve clients each keep one request in flight, every request on an adapter never seen
    before; a thirteenth keeps one in flight on the same adapter r. New adapters kept entering at
    the smallest backlogged counter, which the stream of them pinned, so r (a counter above it
    from its first request) never ran again: 1 request in 400 steps (found by a soak of 2000
    adapters: a client on one adapter waited 8-16 s per request while one-off adapters waited
    under 1 s). The virtual time now advances by each step's fair share and keys enter at it, so
    r's debt from its last request is repaid as the others are served: it got 14 requests against
    21 per new-adapter client, with waits of at most 39 steps against 18 (it was 1 request)."""
    sched, pool, adapters = _setup(num_blocks=4096, max_loras=2, max_num_seqs=4, budget=16)
    r = _ref(adapters, pool, "r")
    live, waits, started, n = {}, {"r": [], "new": []}, set(), 0

    def issue(client: int, step: int) -> None:
        nonlocal n
        ref = r if client == 0 else _ref(adapters, pool, f"new{n}")
        seq = _seq(n, 4, ref, max_tokens=3)
        n += 1
        _add(sched, pool, seq)
        live[seq] = (client, step)

    for client in range(13):
        issue(client, 0)
    for step in range(400):
        _run_step(sched, pool)
        for seq, (client, at) in list(live.items()):
            if seq.num_computed and seq not in started:
                started.add(seq)
                waits["r" if client == 0 else "new"].append(step - at)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                del live[seq]
                issue(client, step + 1)
    per_new_client = len(waits["new"]) / 12
    assert len(waits["r"]) >= 0.5 * per_new_client, (len(waits["r"]), per_new_client)
    assert max(waits["r"]) <= 3 * max(waits["new"]), (max(waits["r"]), max(waits["new"]))


def _rare_wait_beside_base_traffic(arrive_at: int) -> tuple[int, int]:
    """Adapters a and b keep three requests queued each on one device slot (max_loras=1) while the
    base model, which needs no slot, keeps a backlog of 1000-token prompts, at the default token
    budget (2048) and 64 sequences; a rare adapter arrives at ``arrive_at``. Returns (its wait in
    steps, the documented bound)."""
    sched, pool, adapters = _setup(num_blocks=1 << 16, max_loras=1, max_num_seqs=64, budget=2048)
    refs = [_ref(adapters, pool, n) for n in "ab"] + [None]
    rare, n = None, 0
    for step in range(arrive_at + 2000):
        for ref in refs:
            while len(sched.waiting.get(ref, ())) < 3:
                seq = _seq(n, 8 if ref else 1000, ref, max_tokens=8 if ref else 4)
                n += 1
                _add(sched, pool, seq) if ref else sched.add(seq)
        if step == arrive_at:
            rare = _seq(10**6, 6, _ref(adapters, pool, "rare"), max_tokens=3)
            _add(sched, pool, rare)
        _run_step(sched, pool)
        if rare is not None and rare.num_computed:
            return step - arrive_at, sched.fairness_bound_steps(1000, 8)
    raise AssertionError(f"the rare adapter arriving at step {arrive_at} did not start in 2000 steps")


def test_a_new_adapters_wait_does_not_grow_with_uptime():
    """The base model takes the tokens that slot-bound adapters cannot, so a clock advancing by
    fair shares ran ahead of every adapter's counter by more each step, and an adapter arriving
    later entered further behind them: it never started (found by review). Capped at one step's
    budget above the smallest counter, it waited ~740 steps at the default budget (found by a
    second review). The clock now never passes the least served key that ran in the step: the
    rare adapter waits 12-16 steps whenever it arrives, within the documented bound (43 here)."""
    waits = [_rare_wait_beside_base_traffic(at) for at in (300, 1000)]
    assert all(wait <= bound for wait, bound in waits), waits


def _adder(sched, pool, adapters):
    """``add(name, rank, max_tokens)``: one 4-token request of adapter ``name`` (on the host), queued."""
    count = iter(range(10**6))

    def add(name, rank, max_tokens):
        ref = _ref(adapters, pool, name, rank)
        pool.insert_host(ref, adapters[ref])
        i = next(count)
        seq = Sequence(f"s{i}", i, [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens), ref, 0.0)
        _add(sched, pool, seq)
        return seq

    return add


def test_rows_a_drain_frees_are_kept_for_the_adapter_it_drains_for():
    """X (rank 32) needs the rows of two residents (rank 24 each; 96 rows, a busy rank-24 adapter R
    with a queue, 24 free). The drain picks the two nobody waits for; when the first ends, its 24
    rows were taken by the next one-off rank-24 adapter, ranked after X in the same step, and so on
    with each drain: X never started (1000 steps against a bound of 27). Now the keys after X place
    no new adapter while X waits, and X starts within the documented bound."""
    adapters = {}
    pool = AdapterPool(FakeWriter(), lambda ref: adapters[ref], 3, 1000, 96, 32, async_loads=False)
    sched = Scheduler(BlockManager(4096, 4), pool, max_num_seqs=8, max_num_batched_tokens=32, max_loras=3)
    add = _adder(sched, pool, adapters)
    for name, max_tokens in (("S0", 10), ("S1", 20), ("R", 5)):
        add(name, 24, max_tokens)
    _run_step(sched, pool)  # rows 0-24, 24-48 and 48-72 taken
    x = add("X", 32, 3)
    busy, filler, fillers = AdapterRef("R", "v"), None, 0
    for step in range(1, 201):
        while len(sched.waiting.get(busy, ())) < 2:
            add("R", 24, 5)
        if filler is None or filler.num_computed:  # one new one-off rank-24 adapter waiting at any time
            filler = add(f"F{fillers}", 24, (11, 17, 23)[fillers % 3])
            fillers += 1
        _run_step(sched, pool)
        if x.num_computed:
            break
    assert x.num_computed and step <= sched.fairness_bound_steps(4, 23), (step, fillers)


def test_victims_stay_drained_until_none_of_them_runs():
    """X (rank 48) needs the rows of two adjacent rank-24 residents, and all four residents have
    queues. The first victim done draining stopped being a victim, admitted again and took its rows
    back while the other drained, and so on: X started after 67 steps against a bound of 22."""
    adapters = {}
    pool = AdapterPool(FakeWriter(), lambda ref: adapters[ref], 4, 1000, 96, 48, async_loads=False)
    sched = Scheduler(BlockManager(4096, 4), pool, max_num_seqs=8, max_num_batched_tokens=32, max_loras=4)
    add = _adder(sched, pool, adapters)
    busy = {"A": 18, "Z": 8, "B": 11, "C": 11}
    for name, max_tokens in busy.items():
        add(name, 24, max_tokens)
    _run_step(sched, pool)  # the 96 rows full
    x = add("X", 48, 3)
    for step in range(1, 201):
        for name, max_tokens in busy.items():
            while len(sched.waiting.get(AdapterRef(name, "v"), ())) < 2:
                add(name, 24, max_tokens)
        _run_step(sched, pool)
        if x.num_computed:
            break
    assert x.num_computed and step <= sched.fairness_bound_steps(4, max(busy.values())), step


def test_recompute_after_a_preemption_is_not_charged_again():
    """A preempted sequence's recompute costs its key nothing: the victim is the newest running
    sequence, whatever its adapter, and charging its tokens twice put that adapter behind its share.
    Three requests of 7 prompt and 4 output tokens in 4 blocks of 4 tokens: preemptions happen, and
    the key is charged for each token's KV once, 3 * (7 + 3) (the last sampled token gets none)."""
    sched, pool, _ = _setup(num_blocks=4, budget=16)
    for i in range(3):
        sched.add(_seq(i, 7, max_tokens=4))
    charged, preempted = [], 0

    def observe():  # after the step's charges, before finished requests leave (the key is still backlogged)
        charged.append(sched.counters[None])

    while sched.has_unfinished():
        preempted += len(_run_step(sched, pool, observe).preempted)
    assert preempted > 0 and sched.num_preemptions == preempted
    assert charged[-1] == 3 * (7 + 3)


def test_prefix_cache_counts_each_request_once_across_preemptions():
    """A readmission after a preemption looks the prompt up again and mostly finds the request's
    own blocks: counted, it raised the hit rate with every preemption. Distinct prompts share
    nothing, so the honest figures are each prompt's full blocks but the last token's, and no hit."""
    from runtime.kv.prefix_cache import PrefixCache

    cache = PrefixCache("base")
    pool = AdapterPool(FakeWriter(), lambda ref: None, 2, 4, 64, 32, async_loads=False)
    sched = Scheduler(BlockManager(6, 4, cache), pool, max_num_seqs=4, max_num_batched_tokens=16, max_loras=2, prefix_seed=cache.seed)
    prompts = [[100 * i + t for t in range(9)] for i in range(3)]
    for i, prompt in enumerate(prompts):
        sched.add(Sequence(f"s{i}", i, prompt, SamplingParams(max_tokens=6), None, 0.0))
    preempted = 0
    while sched.has_unfinished():
        preempted += len(_run_step(sched, pool).preempted)
    assert preempted > 0
    assert (cache.queried_blocks, cache.hit_blocks) == (sum((len(p) - 1) // 4 for p in prompts), 0)
