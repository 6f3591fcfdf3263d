"""A squeezed engine generates exactly what a roomy one does.

One random workload (prompts shorter and longer than the step budget, five adapters of ranks
4-16 and the base model, prompts sharing prefixes, greedy, seeded and unseeded sampling,
penalties, stop ids, logprobs and prompt logprobs) runs on two engines built on the same
weights and engine seed:

- roomy: a big KV pool, token budget and sequence limit, four device slots: nothing is
  chunked much, nothing is preempted;
- squeezed: a KV pool just big enough for the longest single request (prompt + max_tokens),
  a token budget of a few tokens (long prompts are prefilled in many chunks), 2-3 sequences,
  1-2 device slots: running sequences are preempted and recomputed, adapters take turns.

Requests arrive in the same order on both (so unseeded requests draw the same seeds), at
different steps. Each request's tokens, text, finish reason, logprob token ids and prompt
logprob count must match. The squeezed engine also aborts a request in each of three states
(waiting after a preemption, mid chunked prefill, waiting never started) and must end idle:
every KV block free, no refcount, no adapter demand, and each request's metrics observed
once, with its token counts, its preemptions the ones the scheduler made, and its first token
time that of the first token it streamed (a recompute does not move it).
"""
from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from runtime.request import SamplingParams
from tests.engine_helpers import make_engine, random_prompt
from tests.faults.conftest import idle_problems

BLOCK = 4


def _workload(rng: random.Random, adapters: list) -> list:
    names = [None, *adapters]
    shared = [random_prompt(rng, rng.randint(8, 20)) for _ in range(2)]
    workload = []
    for i in range(14):
        prompt = random_prompt(rng, rng.choice([rng.randint(1, 6), rng.randint(7, 20), rng.randint(20, 40)]))
        if rng.random() < 0.4:  # a shared prefix: prefix-cache hits, and blocks in flight waited for
            prompt = rng.choice(shared) + prompt[: rng.randint(0, 10)]
        n = rng.randint(1, 12)
        kind = rng.random()
        if kind < 0.35:
            params = SamplingParams(max_tokens=n, ignore_eos=True)
        elif kind < 0.6:
            params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, seed=rng.randrange(1 << 40))
        elif kind < 0.75:
            params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, top_k=20)  # seed drawn from the engine's
        elif kind < 0.83:
            params = SamplingParams(max_tokens=rng.choice([0, n]), prompt_logprobs=2, logprobs=1, ignore_eos=True)
        elif kind < 0.91:
            params = SamplingParams(max_tokens=n, temperature=0.7, seed=rng.randrange(100), repetition_penalty=1.3,
                                    frequency_penalty=0.5, min_tokens=rng.randint(0, n))
        else:
            params = SamplingParams(max_tokens=n, stop_token_ids=tuple(rng.sample(range(300), 30)), logprobs=2)
        workload.append((f"r{i}", prompt, params, rng.choice(names)))
    return workload


def _signature(out) -> tuple:
    return (
        out.token_ids,
        out.text,
        out.finish_reason,
        None if out.logprobs is None else [e.token_id for e in out.logprobs],
        None if out.prompt_logprobs is None else len(out.prompt_logprobs),
    )


def _state(engine, request_id: str) -> str:
    seq = engine._live[request_id].seq
    if seq in engine.scheduler.running:
        return "mid-prefill" if 0 < seq.num_computed < len(seq.prompt_token_ids) else "running"
    return "preempted" if seq.preemptions else "waiting"


def _run(engine, adapters: dict, workload: list, rng: random.Random, abort_states: tuple = (), arrived: dict | None = None,
         first_token: dict | None = None) -> tuple[dict, dict]:
    """Every final output (by request id), and the requests aborted (id -> state when aborted).
    Requests arrive 0-3 per step, in workload order; one request in each of ``abort_states`` is aborted.
    ``arrived`` / ``first_token`` get each request's arrival time and the time its first token was returned."""
    arrived = {} if arrived is None else arrived
    first_token = {} if first_token is None else first_token
    for name, path in adapters.items():
        engine.register_adapter(name, str(path))
    pending, finals, aborted = list(workload), {}, {}
    for _ in range(3000):
        if not pending and not engine.has_unfinished():
            return finals, aborted
        for _ in range(rng.randint(0, 3)):
            if pending:
                request_id, prompt, params, adapter = pending.pop(0)
                engine.add_request(request_id, prompt, params, adapter)
                arrived[request_id] = engine._live[request_id].seq.arrival_time
        for request_id in sorted(engine._live):
            state = _state(engine, request_id)
            if state in abort_states and state not in aborted.values():
                aborted[request_id] = state
                engine.abort(request_id)
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            if out.new_token_ids:
                first_token.setdefault(out.request_id, now)
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("seed", [0, 6, 9, 11, 13, 18])  # prefix caching on the even ones; max_loras 1 on 0 and 18
def test_a_squeezed_engine_generates_what_a_roomy_one_does(tiny_llama_dir, tiny_adapters, seed):
    rng = random.Random(seed)
    workload = _workload(rng, list(tiny_adapters))
    longest = max(len(prompt) + params.max_tokens for _, prompt, params, _ in workload)
    prefix_caching = seed % 2 == 0
    roomy = make_engine(tiny_llama_dir, num_kv_blocks=256, block_size=BLOCK, max_num_batched_tokens=256, max_num_seqs=16,
                        max_loras=4, max_cpu_loras=5, enable_prefix_caching=prefix_caching, max_model_len=128)
    squeezed = make_engine(tiny_llama_dir, num_kv_blocks=-(-longest // BLOCK), block_size=BLOCK, max_num_batched_tokens=rng.choice([3, 5]),
                           max_num_seqs=rng.choice([2, 3]), max_loras=rng.choice([1, 2]), max_cpu_loras=5,
                           enable_prefix_caching=prefix_caching, max_model_len=128)
    metrics = []
    squeezed.add_observer(metrics.append)
    made = Counter()  # preemptions the scheduler made, per request
    schedule = squeezed.scheduler.schedule

    def counting_schedule():
        out = schedule()
        made.update(seq.request_id for seq in out.preempted)
        return out

    squeezed.scheduler.schedule = counting_schedule

    expected, _ = _run(roomy, tiny_adapters, workload, random.Random(seed))
    arrived, first_token = {}, {}
    got, aborted = _run(squeezed, tiny_adapters, workload, random.Random(seed + 1), ("preempted", "mid-prefill", "waiting"),
                        arrived, first_token)

    assert sorted(aborted.values()) == ["mid-prefill", "preempted", "waiting"], aborted  # each state was reached and aborted
    assert sum(made.values()) >= 2, "the squeezed pool should force preemption"
    for request_id, _, _, adapter in workload:
        if request_id in aborted:
            assert got[request_id].finish_reason == "abort"
        else:
            assert _signature(got[request_id]) == _signature(expected[request_id]), f"{request_id} (adapter {adapter})"
    assert idle_problems(squeezed.snapshot()) == []
    assert sorted(m.request_id for m in metrics) == sorted(request_id for request_id, *_ in workload)  # each request's once
    prompts = {request_id: prompt for request_id, prompt, *_ in workload}
    for m in metrics:
        assert (m.prompt_tokens, m.output_tokens) == (len(prompts[m.request_id]), len(got[m.request_id].token_ids)), m
        assert m.preemptions == made[m.request_id], m
        if m.ttft is not None:  # first token time: when its first token was made, not when a recompute made the next
            assert arrived[m.request_id] + m.ttft <= first_token[m.request_id], m
    snapshot_preemptions = sum(a.get("preemptions", 0) for a in squeezed.snapshot()["adapters"].values())
    assert snapshot_preemptions == sum(made.values()) == squeezed.snapshot()["preemptions"]
