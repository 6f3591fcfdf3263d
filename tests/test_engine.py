"""LLMEngine: continuous batching equals running each request alone (greedy, fp32), plus
adapter lifetime (hot update, unregister, abort, corrupted files) and fairness."""
from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from runtime.request import PromptTooLongError, RequestRejected, SamplingParams, UnknownAdapterError
from tests.engine_helpers import clone_adapter, copy_adapter, make_engine, random_prompt, run_alone, run_to_completion

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _mixed_workload(rng: random.Random, names: list, n: int):
    return [(f"r{i}", random_prompt(rng, rng.randint(1, 23)), rng.choice(names)) for i in range(n)]


def _references(engine, workload, params=GREEDY):
    return {rid: run_alone(engine, f"alone-{rid}", prompt, params, ad).token_ids for rid, prompt, ad in workload}


@pytest.mark.parametrize(
    "seed, overrides",
    [
        (0, {}),  # roomy KV, 32-token budget: prefill + decode mixed, some chunking
        (1, dict(max_num_batched_tokens=5)),  # heavy chunked prefill
        (2, dict(num_kv_blocks=9, block_size=4)),  # tiny KV pool: forced preemption by recompute
    ],
)
def test_batched_greedy_equals_each_request_alone(tiny_llama_dir, tiny_adapters, seed, overrides):
    engine = make_engine(tiny_llama_dir, **overrides)
    for name, path in tiny_adapters.items():
        engine.register_adapter(name, str(path))
    rng = random.Random(seed)
    workload = _mixed_workload(rng, [None, *tiny_adapters], 10)
    expected = _references(engine, workload)
    # Random arrival: a few requests up front, the rest join while others run.
    pending = list(workload)
    rng.shuffle(pending)
    finals = {}
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                rid, prompt, ad = pending.pop()
                engine.add_request(rid, prompt, GREEDY, ad)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    for rid, _, ad in workload:
        assert finals[rid].finish_reason == "length"
        assert finals[rid].token_ids == expected[rid], f"{rid} (adapter {ad}) differs from its single-request run"
    snap = engine.snapshot()
    if overrides.get("num_kv_blocks") == 9:
        assert sum(a.get("preemptions", 0) for a in snap["adapters"].values()) > 0, "the tiny KV pool should force preemption"
    assert snap["kv_blocks_free"] == snap["kv_blocks_total"]
    assert snap["total_refcounts"] == {"adapter_demand": 0, "adapter_device_refs": 0}


def test_adapters_change_outputs(tiny_llama_dir, tiny_adapters):
    """Guards the equality tests above against an engine that ignores adapters."""
    engine = make_engine(tiny_llama_dir)
    for name, path in tiny_adapters.items():
        engine.register_adapter(name, str(path))
    prompt = random_prompt(random.Random(5), 12)
    outs = {ad: run_alone(engine, f"x-{ad}", prompt, GREEDY, ad).token_ids for ad in [None, *tiny_adapters]}
    assert len(set(outs.values())) == len(outs)


def test_fifty_adapters_in_rotation(tiny_llama_dir, tiny_adapters, tmp_path):
    """max_loras=4, max_cpu_loras=8, 50 adapters of mixed rank: every output equals its reference."""
    engine = make_engine(tiny_llama_dir, max_loras=4, max_cpu_loras=8, max_num_seqs=16, num_kv_blocks=128)
    names = []
    for i in range(50):
        src = tiny_adapters["b" if i % 2 else "c"]
        path = clone_adapter(Path(src), tmp_path / f"ad{i}", seed=100 + i, r=(4, 8, 16)[i % 3])
        engine.register_adapter(f"ad{i}", str(path))
        names.append(f"ad{i}")
    rng = random.Random(7)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    workload = [(f"r{i}", random_prompt(rng, rng.randint(2, 9)), names[i % 50]) for i in range(60)]
    expected = _references(engine, workload, params)
    for rid, prompt, ad in workload:
        engine.add_request(rid, prompt, params, ad)
    finals = run_to_completion(engine)
    for rid, _, _ in workload:
        assert finals[rid].token_ids == expected[rid]
    snap = engine.snapshot()
    assert snap["pool"]["host_entries"] <= 8
    counters = [a for a in snap["adapters"].values() if "device_loads" in a]
    assert sum(a["device_loads"] for a in counters) >= 50  # every adapter went through the 4 slots...
    assert sum(a["device_evictions"] for a in counters) >= 46  # ...so at least 46 were evicted from them
    assert sum(a["host_evictions"] for a in counters) > 0


def test_step_never_exceeds_max_loras(tiny_llama_dir, tiny_adapters):
    engine = make_engine(tiny_llama_dir, max_loras=2, max_cpu_loras=5)
    for name, path in tiny_adapters.items():
        engine.register_adapter(name, str(path))
    rng = random.Random(3)
    for rid, prompt, ad in _mixed_workload(rng, list(tiny_adapters), 12):
        engine.add_request(rid, prompt, GREEDY, ad)
    per_step: list[int] = []  # distinct adapters in each batch the model actually ran
    execute, schedule = engine.runner.execute, engine.scheduler.schedule
    planned = []

    def recording_schedule():
        planned.append(schedule())
        return planned[-1]

    def counting_execute(steps):
        chunks = planned[-1].chunks
        assert len(chunks) == len(steps)
        residents = engine.pool.device_residents()
        for chunk, step in zip(chunks, steps):
            if chunk.seq.adapter is not None:  # the slot the row reads holds this row's adapter now
                assert residents[step.lora_slot][0] == chunk.seq.adapter
        per_step.append(len({c.seq.adapter for c in chunks if c.seq.adapter is not None}))
        return execute(steps)

    engine.scheduler.schedule = recording_schedule
    engine.runner.execute = counting_execute
    run_to_completion(engine)
    assert per_step and max(per_step) == 2  # the cap is reached, never passed


def test_starvation_bound_with_three_adapters(tiny_llama_dir, tiny_adapters):
    """max_loras=2, steady traffic on a and b: c's request is admitted within the documented bound."""
    budget = 8
    engine = make_engine(tiny_llama_dir, max_loras=2, max_cpu_loras=3, max_num_batched_tokens=budget, max_num_seqs=8, num_kv_blocks=256)
    for name in ("a", "b", "c"):
        engine.register_adapter(name, str(tiny_adapters[name]))
    rng = random.Random(11)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt_len = 6
    counter = 0
    c_added_step = c_first_step = None
    for step in range(120):
        for ad in ("a", "b"):  # steady: both popular adapters always have waiting requests
            if engine.scheduler.num_waiting < 12:
                engine.add_request(f"{ad}{counter}", random_prompt(rng, prompt_len), params, ad)
                counter += 1
        if step == 10:
            engine.add_request("rare", random_prompt(rng, prompt_len), params, "c")
            c_added_step = engine.steps
        for out in engine.step():
            if out.request_id == "rare" and c_first_step is None:
                c_first_step = engine.steps
        if c_first_step is not None:
            break
    assert c_first_step is not None, "the rare adapter was starved"
    assert engine.scheduler.num_waiting > 0  # a and b really were backlogged the whole time
    bound = engine.scheduler.fairness_bound_steps(prompt_len, params.max_tokens)
    assert c_first_step - c_added_step <= bound, (c_first_step - c_added_step, bound)


def test_hot_update_in_flight_requests_finish_on_old_version(tiny_llama_dir, tiny_adapters, tmp_path):
    engine = make_engine(tiny_llama_dir)
    v1 = copy_adapter(Path(tiny_adapters["b"]), tmp_path / "live")
    ref1 = engine.register_adapter("live", str(v1))
    prompt = random_prompt(random.Random(1), 10)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    old_alone = run_alone(engine, "old-alone", prompt, params, "live").token_ids
    engine.add_request("old", prompt, params, "live")
    engine.step()
    engine.step()
    # Overwrite the same folder in place with new weights, then hot-update the name.
    clone_adapter(Path(tiny_adapters["b"]), tmp_path / "live", seed=999)
    ref2 = engine.register_adapter("live", str(v1))
    assert ref2.name == ref1.name and ref2.version != ref1.version
    engine.add_request("new", prompt, params, "live")
    finals = run_to_completion(engine)
    assert finals["old"].adapter == ref1 and finals["old"].token_ids == old_alone
    assert finals["new"].adapter == ref2 and finals["new"].token_ids != old_alone
    assert ref1 not in engine.pool.host_refs(), "old version must be freed after its last reader"
    assert all(r != ref1 for r, _, _ in engine.pool.device_residents().values())
    assert [(i.name, i.version) for i in engine.adapters()] == [("live", ref2.version)]


def test_unregister_refuses_new_requests_and_frees_after_last_reader(tiny_llama_dir, tiny_adapters):
    engine = make_engine(tiny_llama_dir)
    ref = engine.register_adapter("a", str(tiny_adapters["a"]))
    engine.add_request("inflight", [1, 2, 3, 4], GREEDY, "a")
    engine.step()
    engine.unregister_adapter("a")
    with pytest.raises(UnknownAdapterError, match="'a'"):
        engine.add_request("late", [1, 2, 3], GREEDY, "a")
    assert ref in engine.pool.host_refs()  # still read by "inflight"
    finals = run_to_completion(engine)
    assert finals["inflight"].finish_reason == "length"
    assert ref not in engine.pool.host_refs() and not engine.pool.device_residents()
    with pytest.raises(UnknownAdapterError):
        engine.unregister_adapter("a")


def test_abort_releases_blocks_and_references_including_pending_loads(tiny_llama_dir, tiny_adapters):
    engine = make_engine(tiny_llama_dir, max_loras=2, max_cpu_loras=2)
    for name in ("a", "b", "c", "d"):  # host holds 2, so some adapters live only on disk
        engine.register_adapter(name, str(tiny_adapters[name]))
    for i, ad in enumerate(("a", "b", "c", "d", None)):
        engine.add_request(f"q{i}", random_prompt(random.Random(i), 9), GREEDY, ad)
    engine.step()
    for i in range(5):
        assert engine.abort(f"q{i}")
    finals = run_to_completion(engine)
    assert {o.finish_reason for o in finals.values()} == {"abort"}
    snap = engine.snapshot()
    assert snap["total_refcounts"] == {"adapter_demand": 0, "adapter_device_refs": 0}
    assert snap["kv_blocks_free"] == snap["kv_blocks_total"] and snap["kv_block_refcount_total"] == 0
    assert snap["running"] == 0 and snap["waiting"] == 0
    assert not engine.abort("q0")


def test_an_aborted_id_stays_taken_until_its_final_output_is_returned(tiny_llama_dir):
    """Reusing the id at once would make the next step return two requests under one id."""
    engine = make_engine(tiny_llama_dir)
    engine.add_request("r1", [5, 6, 7], GREEDY)
    engine.step()
    assert engine.abort("r1")
    with pytest.raises(ValueError, match="'r1' is already in flight"):
        engine.add_request("r1", [5, 6, 7], GREEDY)
    (final,) = engine.step()
    assert final.request_id == "r1" and final.finish_reason == "abort"
    engine.add_request("r1", [5, 6, 7], GREEDY)  # free again
    assert [o.request_id for o in engine.step()] == ["r1"]


def test_corrupted_adapter_fails_only_its_requests(tiny_llama_dir, tiny_adapters, tmp_path, caplog):
    engine = make_engine(tiny_llama_dir, max_loras=1, max_cpu_loras=1)
    broken = copy_adapter(Path(tiny_adapters["a"]), tmp_path / "broken")
    engine.register_adapter("broken", str(broken))
    engine.register_adapter("b", str(tiny_adapters["b"]))  # evicts "broken" from the 1-entry host tier
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])  # truncated on disk after registration
    engine.add_request("bad", [5, 6, 7], GREEDY, "broken")
    engine.add_request("good", [5, 6, 7], GREEDY, "b")
    engine.add_request("base", [5, 6, 7], GREEDY, None)
    with caplog.at_level(logging.WARNING, logger="runtime.engine"):
        finals = run_to_completion(engine)
    assert finals["bad"].finish_reason == "error"
    assert str(broken) in finals["bad"].error and "changed on disk" in finals["bad"].error
    assert any("adapter_model.safetensors" in r.getMessage() for r in caplog.records)  # the file and the reason: in the log only
    assert finals["good"].finish_reason == "length" and finals["base"].finish_reason == "length"
    assert engine.snapshot()["total_refcounts"]["adapter_demand"] == 0


def test_add_request_rejects_at_once(tiny_llama_dir, tiny_adapters):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(UnknownAdapterError, match="nope"):
        engine.add_request("u", [1, 2], GREEDY, "nope")
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        engine.add_request("long", [1] * 64, GREEDY)
    with pytest.raises(PromptTooLongError, match="max_tokens"):
        engine.add_request("long2", [1] * 60, SamplingParams(max_tokens=8))
    with pytest.raises(RequestRejected, match=r"^max_tokens: .*num_kv_blocks"):  # the prompt fits; with its output it does not
        engine.add_request("huge", [1] * 14, SamplingParams(max_tokens=8))
    with pytest.raises(RequestRejected, match=r"^prompt: 17 tokens .*holds 16 tokens \(4 num_kv_blocks of 4\)"):
        engine.add_request("huge-prompt", [1] * 17, SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejected, match=r"^prompt: 16 tokens \(\+ at least 1 of output\)"):  # fills the pool: no room left
        engine.add_request("full-prompt", [1] * 16, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="prompt: empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="prompt: token ids"):
        engine.add_request("vocab", [10**6], GREEDY)
    assert not engine.has_unfinished()
    # The boundary: prompt + max_tokens up to the pool's 16 tokens, as the server's banner and default max_tokens say.
    with pytest.raises(RequestRejected, match=r"^max_tokens: prompt \(9 tokens\) \+ max_tokens \(8\) = 17 tokens"):
        engine.add_request("one-too-many", [1] * 9, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("fits", [1] * 8, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("scores-a-full-pool", [1] * 16, SamplingParams(max_tokens=0))  # prompt only (echo scoring): no output
    finals = run_to_completion(engine)
    assert len(finals["fits"].token_ids) == 8 and finals["scores-a-full-pool"].token_ids == ()


def test_observer_metrics_and_stop_strings(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    seen = []
    engine.add_observer(seen.append)
    free = run_alone(engine, "free", "hello", SamplingParams(max_tokens=12, ignore_eos=True), None)
    assert len(free.text) > 3
    stop = free.text[2:4]
    first = free.text.find(stop)
    out = run_alone(engine, "stopped", "hello", SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)), None)
    assert out.finish_reason == "stop" and out.text == free.text[:first]
    m = {x.request_id: x for x in seen}
    assert m["free"].output_tokens == 12 and m["free"].finish_reason == "length"
    assert m["free"].ttft is not None and m["free"].queue_time is not None and m["free"].adapter_location == "none"


def test_async_engine_streams_matches_sync_and_cancel_aborts(tiny_llama_dir, tiny_adapters):
    import asyncio

    from runtime.async_engine import AsyncLLMEngine

    sync = make_engine(tiny_llama_dir)
    sync.register_adapter("a", str(tiny_adapters["a"]))
    expected = run_alone(sync, "ref", [3, 1, 4, 1, 5], GREEDY, "a").token_ids
    engine = AsyncLLMEngine(None, engine=make_engine(tiny_llama_dir))
    engine.register_adapter("a", str(tiny_adapters["a"]))
    engine.start()

    async def main():
        pieces = [o async for o in engine.generate("s", [3, 1, 4, 1, 5], GREEDY, "a")]
        long = SamplingParams(max_tokens=40, ignore_eos=True)

        started = asyncio.Event()

        async def consume():
            stream = engine.generate("cancelled", [1, 2, 3], long, None)
            try:
                async for _ in stream:
                    started.set()
                    await asyncio.sleep(3600)  # a slow consumer: cancelled while the request is live
            finally:
                await stream.aclose()  # what a cancelled HTTP handler does; it must abort the request

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pieces

    pieces = asyncio.run(main())
    assert tuple(t for p in pieces for t in p.new_token_ids) == expected and pieces[-1].finished
    snap = engine.snapshot()
    assert snap["running"] == 0 and snap["waiting"] == 0 and snap["kv_blocks_free"] == snap["kv_blocks_total"]
    engine.shutdown(timeout=5)


def test_close_frees_the_model_and_kv_cache_at_once(tiny_llama_dir, tiny_adapters):
    """The engine and its pool reference each other, so close() must release the big
    buffers itself rather than leave them to the cycle collector."""
    import weakref

    engine = make_engine(tiny_llama_dir)
    engine.register_adapter("a", str(tiny_adapters["a"]))
    run_alone(engine, "r0", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), "a")
    kv = weakref.ref(engine.runner.kv_caches[0])
    some_lora_buffer = weakref.ref(next(iter(engine.runner.model.all_slices()))[2].b_rows)
    engine.close()
    assert kv() is None and some_lora_buffer() is None
    with pytest.raises(RuntimeError, match="released"):
        engine.runner.memory_report()


def test_an_adapter_folder_of_the_wrong_type_is_a_type_error(tiny_llama_dir, tiny_adapters):
    """register_adapter(name, None) said "None: adapter folder does not exist" (str(None) looked
    up as a folder); a wrong type is a TypeError naming the types taken, from the engine and from
    AsyncLLMEngine. A pathlib.Path is taken."""
    from runtime.async_engine import AsyncLLMEngine

    engine = make_engine(tiny_llama_dir)
    for folder in (None, 3, b"/adapters/a", ["/adapters/a"]):
        with pytest.raises(TypeError, match=f"adapter folder: expected a str or os.PathLike, got {type(folder).__name__}"):
            engine.register_adapter("a", folder)
    engine.register_adapter("a", tiny_adapters["a"])
    wrapped = AsyncLLMEngine(None, engine=engine)
    try:
        with pytest.raises(TypeError, match="adapter folder: expected a str or os.PathLike, got NoneType"):
            wrapped.register_adapter("b", None)
        assert [info.name for info in wrapped.adapters()] == ["a"]
    finally:
        wrapped.shutdown(timeout=5)


def test_an_adapter_name_of_the_wrong_type_is_a_type_error(tiny_llama_dir, tiny_adapters):
    """A name that is no str (None, an int, bytes) was a ValueError, where the folder's wrong type
    is a TypeError; now it is a TypeError too, from the engine and from AsyncLLMEngine, and
    nothing is registered. A bad string stays a ValueError."""
    from runtime.async_engine import AsyncLLMEngine

    engine = make_engine(tiny_llama_dir)
    for name in (None, 3, b"a"):
        with pytest.raises(TypeError, match=f"adapter name: expected a str, got {type(name).__name__}"):
            engine.register_adapter(name, tiny_adapters["a"])
    with pytest.raises(ValueError, match="adapter name: must be a non-empty string"):
        engine.register_adapter(" a", tiny_adapters["a"])
    wrapped = AsyncLLMEngine(None, engine=engine)
    try:
        with pytest.raises(TypeError, match="adapter name: expected a str, got NoneType"):
            wrapped.register_adapter(None, str(tiny_adapters["a"]))
        assert wrapped.adapters() == []
    finally:
        wrapped.shutdown(timeout=5)


def test_a_closed_engine_refuses_requests_steps_and_adapter_changes(tiny_llama_dir, tiny_adapters):
    """After close() add_request queued the request without a word (only the next step failed,
    on the released runner) and register_adapter installed an adapter; now each is a
    RuntimeError, as for a closed LLM. abort and the reports still answer; close is idempotent."""
    engine = make_engine(tiny_llama_dir)
    engine.register_adapter("a", str(tiny_adapters["a"]))
    engine.close()
    closed = "LLMEngine: closed; create a new LLMEngine"
    calls = [lambda: engine.add_request("r0", [5, 6, 7], GREEDY), lambda: engine.check_request("r0", [5, 6, 7], GREEDY),
             engine.step, lambda: engine.register_adapter("b", str(tiny_adapters["b"])), lambda: engine.unregister_adapter("a")]
    for call in calls:
        with pytest.raises(RuntimeError, match=closed):
            call()
    assert not engine.has_unfinished() and [info.name for info in engine.adapters()] == ["a"]
    assert engine.abort("r0") is False and engine.snapshot()["running"] == 0
    engine.close()


def test_request_metrics_adapter_wait(tiny_llama_dir, tiny_adapters):
    """Per-request adapter wait: 0 when the adapter was on the host, the disk load's duration
    (> 0) when it was on disk only, None for the base model."""
    engine = make_engine(tiny_llama_dir, max_loras=1, max_cpu_loras=1)
    on_disk, on_host = sorted(tiny_adapters)[:2]
    for name in (on_disk, on_host):  # the 1-entry host tier keeps only the second
        engine.register_adapter(name, str(tiny_adapters[name]))
    seen = {}
    engine.add_observer(lambda m: seen.__setitem__(m.request_id, m))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for rid, adapter in (("host", on_host), ("base", None)):
        engine.add_request(rid, [1, 2, 3], params, adapter)
    run_to_completion(engine)
    engine.add_request("disk", [1, 2, 3], params, on_disk)
    run_to_completion(engine)
    assert seen["host"].adapter_location == "host" and seen["host"].adapter_wait == 0.0
    assert seen["disk"].adapter_location == "disk" and seen["disk"].adapter_wait > 0.0
    assert seen["disk"].adapter_wait <= seen["disk"].queue_time  # it could not start before its adapter was there
    assert seen["base"].adapter_wait is None


def test_an_adapter_read_from_disk_is_not_starved_by_a_busy_host_tier(tiny_llama_dir, tiny_adapters):
    """One host entry, held by an adapter whose requests never stop: a request of another adapter
    still runs soon (the busy adapter is drained and evicted for its read), instead of waiting
    until the traffic stops."""
    engine = make_engine(tiny_llama_dir, max_loras=1, max_cpu_loras=1)
    engine.register_adapter("busy", str(tiny_adapters["a"]))
    engine.register_adapter("rare", str(tiny_adapters["b"]))  # evicts busy from the 1-entry host tier: both on disk now
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    finals: dict = {}
    for step in range(300):
        if sum(1 for k in engine._live if k.startswith("busy")) < 3:  # steady traffic on busy
            engine.add_request(f"busy-{step}", [5, 6, 7], params, "busy")
        if step == 5:
            engine.add_request("rare", [5, 6, 7], params, "rare")
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if "rare" in finals:
            break
        engine.pool.wait_for_load(timeout=0.01)
    assert "rare" in finals and finals["rare"].finish_reason == "length", f"rare still waiting after {step} steps"
    assert step < 100
    for request_id in list(engine._live):
        engine.abort(request_id)
    run_to_completion(engine)
    snap = engine.snapshot()
    assert snap["total_refcounts"] == {"adapter_demand": 0, "adapter_device_refs": 0}


def test_step_budget_defaults_by_device(tiny_llama_dir):
    """Without max_num_batched_tokens the cpu gets max(256, max_num_seqs) (smaller steps run faster
    there; docs/benchmarks.md) and a GPU/NPU max(2048, max_num_seqs); a given budget is kept, a bad one refused."""
    from runtime.config import CPU_BATCHED_TOKENS, DEFAULT_BATCHED_TOKENS, ConfigError, EngineConfig

    base = EngineConfig(model=str(tiny_llama_dir), device="cpu")
    assert base.max_num_batched_tokens is None
    assert base.for_backend("cpu").max_num_batched_tokens == CPU_BATCHED_TOKENS == 256
    assert base.replace(max_num_seqs=300).for_backend("cpu").max_num_batched_tokens == 300  # every decode fits a step
    assert base.for_backend("cuda").max_num_batched_tokens == base.for_backend("npu").max_num_batched_tokens == DEFAULT_BATCHED_TOKENS == 2048
    assert base.replace(max_num_seqs=4096).for_backend("cuda").max_num_batched_tokens == 4096  # every decode fits there too
    assert base.replace(max_num_batched_tokens=40).for_backend("cpu").max_num_batched_tokens == 40
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=None, max_num_seqs=3, num_kv_blocks=128)
    try:
        assert engine.config.max_num_batched_tokens == engine.scheduler.max_num_batched_tokens == 256
        assert engine.runner.workspace.shape[1] == 256
        rng = random.Random(1)
        for i in range(3):  # 360 prompt tokens: more than one step's budget
            engine.add_request(f"r{i}", random_prompt(rng, 120), SamplingParams(max_tokens=1), None)
        finals = run_to_completion(engine)
        assert sorted(finals) == ["r0", "r1", "r2"] and all(len(f.token_ids) == 1 for f in finals.values())
        assert engine.steps == 2
    finally:
        engine.close()
    for bad in (0, -5, True, 1.5):
        with pytest.raises(ConfigError, match="max_num_batched_tokens"):
            EngineConfig(model=str(tiny_llama_dir), max_num_batched_tokens=bad)


@pytest.mark.parametrize("cpu_gemm", ["auto", "onednn", "mkl"])
def test_cpu_gemm_chooses_how_float32_weights_are_stored(tiny_llama_dir, monkeypatch, cpu_gemm):
    """cpu_gemm onednn packs the float32 projections (and untied LM head) for oneDNN, mkl keeps them
    plain on F.linear, auto takes this CPU's choice and the resolved config says which; every
    choice generates the same greedy tokens."""
    from runtime.models import dense

    if cpu_gemm == "onednn" and not dense.PACKED_WEIGHTS:
        pytest.skip("this torch cannot pack weights for oneDNN")
    monkeypatch.setattr(dense, "ONEDNN_MIN_WEIGHT", 0)  # the tiny model's weights count as large
    want_packed = dense.float32_packed(cpu_gemm) and dense.PACKED_WEIGHTS
    results = {}
    for choice in (cpu_gemm, "mkl"):
        engine = make_engine(tiny_llama_dir, cpu_gemm=choice)
        try:
            assert engine.config.cpu_gemm == ("onednn" if dense.float32_packed(choice) else "mkl")  # auto spelt out
            model = engine.runner.model
            packed = [lin.weight.is_mkldnn for layer in model.layers for lin in layer.projections.values()]
            assert packed == [want_packed if choice == cpu_gemm else False] * len(packed)
            rng = random.Random(3)
            for i in range(3):
                engine.add_request(f"r{i}", random_prompt(rng, 9), SamplingParams(max_tokens=6), None)
            results[choice] = {k: v.token_ids for k, v in run_to_completion(engine).items()}
        finally:
            engine.close()
    assert results[cpu_gemm] == results["mkl"]


def test_cpu_gemm_is_checked_and_refused_off_the_cpu(tiny_llama_dir):
    from runtime.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="cpu_gemm: 'blas' is not one of auto, onednn, mkl"):
        EngineConfig(model=str(tiny_llama_dir), cpu_gemm="blas")
    config = EngineConfig(model=str(tiny_llama_dir), cpu_gemm="mkl")
    assert config.for_backend("cpu").cpu_gemm == "mkl"
    with pytest.raises(ConfigError, match="cpu_gemm: 'mkl' chooses the cpu backend's float32 GEMM; this engine runs on cuda"):
        config.for_backend("cuda")
    assert EngineConfig(model=str(tiny_llama_dir)).for_backend("npu").cpu_gemm == "auto"  # nothing to choose there
    for dtype in ("bfloat16", "float16"):  # the choice would change nothing: refused, not ignored
        with pytest.raises(ConfigError, match=f"cpu_gemm: 'onednn' chooses the float32 GEMM; with dtype {dtype} it would change nothing"):
            EngineConfig(model=str(tiny_llama_dir), cpu_gemm="onednn", dtype=dtype).for_backend("cpu")
        resolved = EngineConfig(model=str(tiny_llama_dir), dtype=dtype).for_backend("cpu")
        assert resolved.cpu_gemm == "auto" and resolved.for_backend("cpu") == resolved  # nothing chosen; resolving twice is fine
