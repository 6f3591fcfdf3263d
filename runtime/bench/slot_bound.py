"""How few engine steps an offline workload can take when adapters must hold device slots.

A request with ``o`` output tokens takes part in at least ``o`` steps: the step that
finishes its prefill samples the first token, then one decode per step. Each step in
which a request runs needs the request's adapter in one of the ``max_loras`` device
slots (the base model needs none). Adapter ``a`` therefore appears in at least
``L_a = max o`` over its requests steps, and a step holds at most ``max_loras``
adapters, so with ``S = max_num_seqs`` any schedule takes

    steps >= max( ceil(sum_a L_a / max_loras),  ceil(sum_r o_r / S),  max_r o_r )

(``lower_bound``). It holds even for a scheduler that pauses running requests to rotate
adapters through the slots, which lorafleet's does not do.

lorafleet's scheduler keeps a request's adapter in its slot from the request's first
token to its last, so each adapter holds a slot for a run of at least ``L_a`` steps.
``packed`` is the fewest steps of such a schedule when every adapter's requests start
together: the smallest makespan of the runs ``L_a`` on ``max_loras`` slots (bin packing),
raised to ``lower_bound`` where that is larger (the packing ignores ``max_num_seqs``). It
is found exactly by a depth-first search when that ends within ``search_nodes`` nodes
(``packed_exact``); otherwise it is the longest-first packing (LPT, within 4/3 of the
best, Graham 1969). Either way it needs every output length up front, which a server does
not have: a yardstick for the measured step count, not a promise.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class SlotBound:
    adapters: int  # distinct adapters among the requests
    slot_steps: int  # sum over adapters of their longest request's output tokens
    lower_bound: int  # no schedule under these limits takes fewer steps
    packed: int  # steps of the best schedule found that holds each adapter's slot once
    packed_exact: bool  # packed is the best such schedule (search finished), not LPT's

    def as_dict(self) -> dict[str, object]:
        return {"adapters": self.adapters, "slot_steps": self.slot_steps, "lower_bound_steps": self.lower_bound,
                "packed_steps": self.packed, "packed_exact": self.packed_exact}


def slot_bound(
    requests: Iterable[tuple[Optional[str], int]], max_loras: int, max_num_seqs: int, search_nodes: int = 200_000
) -> SlotBound:
    """``requests``: (adapter name or None for the base model, output tokens) per request."""
    if max_loras < 1 or max_num_seqs < 1:
        raise ValueError(f"max_loras ({max_loras}) and max_num_seqs ({max_num_seqs}) must be at least 1")
    longest: dict[str, int] = {}
    lengths = []
    for adapter, out in requests:
        if out < 1:
            raise ValueError(f"a request must generate at least one token, got {out}")
        lengths.append(out)
        if adapter is not None:
            longest[adapter] = max(longest.get(adapter, 0), out)
    if not lengths:
        return SlotBound(0, 0, 0, 0, True)
    runs = sorted(longest.values(), reverse=True)
    slot_steps = sum(runs)
    lower = max(-(-slot_steps // max_loras), -(-sum(lengths) // max_num_seqs), max(lengths))
    lpt = longest_first_makespan(runs, max_loras)
    best, exact = lpt, True
    for target in range(lower, lpt):  # the smallest makespan the search can prove feasible
        found = fits(runs, max_loras, target, search_nodes)
        if found is None:
            exact = False
            break
        if found:
            best = target
            break
    return SlotBound(len(longest), slot_steps, lower, max(best, lower), exact)


def longest_first_makespan(runs: list[int], slots: int) -> int:
    """List scheduling, longest run first, each on the slot that frees first."""
    free_at = [0] * slots
    for run in sorted(runs, reverse=True):
        heapq.heappush(free_at, heapq.heappop(free_at) + run)
    return max(free_at)


def fits(runs: list[int], slots: int, capacity: int, max_nodes: int) -> Optional[bool]:
    """Whether ``runs`` pack into ``slots`` bins of ``capacity``; None when the search gives up."""
    runs = sorted(runs, reverse=True)
    remaining = [sum(runs[i:]) for i in range(len(runs) + 1)]
    loads = [0] * slots
    failed: set[tuple[int, tuple[int, ...]]] = set()
    nodes = 0

    def place(i: int) -> Optional[bool]:
        nonlocal nodes
        if i == len(runs):
            return True
        state = (i, tuple(sorted(loads)))
        # Room a bin has left but that no remaining run fits is lost; more lost than the slack: no packing.
        lost = sum(capacity - load for load in loads if load + runs[-1] > capacity)
        if state in failed or remaining[i] > slots * capacity - sum(loads) - lost:
            return False
        nodes += 1
        if nodes > max_nodes:
            return None
        tried = set()
        for b in range(slots):  # bins with equal loads are interchangeable: try one of them
            if loads[b] + runs[i] <= capacity and loads[b] not in tried:
                tried.add(loads[b])
                loads[b] += runs[i]
                result = place(i + 1)
                loads[b] -= runs[i]
                if result is not False:
                    return result
        failed.add(state)
        return False

    return place(0)
