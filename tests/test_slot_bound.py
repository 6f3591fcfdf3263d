"""runtime.bench.slot_bound: hand-worked cases, and the engine never beats the lower bound."""
from __future__ import annotations

import itertools
import random

import pytest

from runtime.bench.slot_bound import fits, longest_first_makespan, slot_bound
from runtime.request import SamplingParams
from tests.engine_helpers import make_engine, random_prompt, run_to_completion


def test_hand_worked_bounds():
    requests = [("a", 5), ("a", 3), ("b", 4), ("c", 2), (None, 7)]
    one = slot_bound(requests, max_loras=1, max_num_seqs=10)
    # a holds a slot 5 steps, b 4, c 2; one slot: 11 steps, every adapter after the other.
    assert (one.adapters, one.slot_steps, one.lower_bound, one.packed, one.packed_exact) == (3, 11, 11, 11, True)
    two = slot_bound(requests, max_loras=2, max_num_seqs=10)
    # ceil(11 / 2) = 6, but the base request alone takes 7 steps; packing {a}, {b, c}: 6, raised to 7.
    assert (two.lower_bound, two.packed) == (7, 7)
    seqs = slot_bound(requests, max_loras=8, max_num_seqs=1)
    assert seqs.lower_bound == 5 + 3 + 4 + 2 + 7  # one sequence at a time
    runs = [3, 3, 2, 2, 2]
    # Longest first on two slots: 3 | 3, then 2 -> 5 | 3, 2 -> 5 | 5, 2 -> 7 | 5: 7; the best is 3+3 | 2+2+2 = 6.
    assert longest_first_makespan(runs, 2) == 7
    best = slot_bound([(f"x{i}", n) for i, n in enumerate(runs)], max_loras=2, max_num_seqs=10)
    assert (best.slot_steps, best.lower_bound, best.packed, best.packed_exact) == (12, 6, 6, True)
    # Lower bound ceil(9 / 2) = 5, but three runs of 3 on two slots need 6.
    three = slot_bound([("a", 3), ("b", 3), ("c", 3)], max_loras=2, max_num_seqs=10)
    assert (three.lower_bound, three.packed) == (5, 6)


def _brute_force_makespan(runs: list[int], slots: int) -> int:
    return min(max(sum(r for r, s in zip(runs, assign) if s == k) for k in range(slots))
               for assign in itertools.product(range(slots), repeat=len(runs)))


def test_packing_is_the_brute_force_optimum():
    rng = random.Random(11)
    for _ in range(60):
        slots = rng.randint(1, 3)
        runs = [rng.randint(1, 9) for _ in range(rng.randint(1, 7))]
        got = slot_bound([(f"x{i}", n) for i, n in enumerate(runs)], max_loras=slots, max_num_seqs=100)
        assert got.packed_exact and got.packed == _brute_force_makespan(runs, slots), (runs, slots)
        assert got.lower_bound <= got.packed <= longest_first_makespan(runs, slots)


def test_search_budget_falls_back_to_longest_first():
    requests = [(f"x{i}", n) for i, n in enumerate([3, 3, 2, 2, 2])]  # longest first 7, best 6 (above)
    capped = slot_bound(requests, max_loras=2, max_num_seqs=100, search_nodes=1)
    assert (capped.packed, capped.packed_exact) == (7, False)
    assert fits([3, 3, 2, 2, 2], 2, 6, max_nodes=1) is None
    assert fits([3, 3, 2, 2, 2], 2, 6, max_nodes=100) is True and fits([3, 3, 2, 2, 2], 2, 5, max_nodes=100) is False


def test_rejects_bad_limits_and_lengths():
    with pytest.raises(ValueError, match="max_loras"):
        slot_bound([("a", 1)], max_loras=0, max_num_seqs=4)
    with pytest.raises(ValueError, match="at least one token"):
        slot_bound([("a", 0)], max_loras=1, max_num_seqs=4)
    assert slot_bound([], max_loras=1, max_num_seqs=1).lower_bound == 0


@pytest.mark.parametrize("seed, max_loras, max_num_seqs", [(0, 1, 8), (1, 2, 3), (2, 2, 8)])
def test_engine_steps_never_beat_the_lower_bound(tiny_llama_dir, tiny_adapters, seed, max_loras, max_num_seqs):
    """Offline, random lengths, mixed adapters and base rows: the engine takes at least the bound's steps."""
    rng = random.Random(seed)
    engine = make_engine(tiny_llama_dir, max_loras=max_loras, max_cpu_loras=len(tiny_adapters), max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=64, num_kv_blocks=256)
    for name, path in tiny_adapters.items():
        engine.register_adapter(name, str(path))
    requests = [(rng.choice([None, *tiny_adapters]), rng.randint(1, 9)) for _ in range(12)]
    for i, (adapter, out) in enumerate(requests):
        engine.add_request(f"r{i}", random_prompt(rng, rng.randint(1, 12)), SamplingParams(max_tokens=out, ignore_eos=True), adapter)
    finals = run_to_completion(engine)
    assert sorted(len(f.token_ids) for f in finals.values()) == sorted(out for _, out in requests)
    bound = slot_bound(requests, max_loras, max_num_seqs)
    assert engine.steps >= bound.lower_bound


def test_one_slot_and_one_request_per_adapter_wastes_no_step(tiny_llama_dir, tiny_adapters):
    """max_loras 1, each adapter's single request admitted as the previous one frees the slot:
    the engine takes exactly the sum of the output lengths, the bound (no idle step between adapters)."""
    rng = random.Random(3)
    engine = make_engine(tiny_llama_dir, max_loras=1, max_cpu_loras=len(tiny_adapters), max_num_batched_tokens=64, num_kv_blocks=256)
    for name, path in tiny_adapters.items():
        engine.register_adapter(name, str(path))
    requests = [(name, rng.randint(2, 7)) for name in tiny_adapters]
    for i, (adapter, out) in enumerate(requests):
        engine.add_request(f"r{i}", random_prompt(rng, 6), SamplingParams(max_tokens=out, ignore_eos=True), adapter)
    run_to_completion(engine)
    bound = slot_bound(requests, max_loras=1, max_num_seqs=8)
    assert bound.lower_bound == sum(out for _, out in requests)
    assert engine.steps == bound.lower_bound
