"""Abort at precise points, stepping the engine by hand: during prefill, during decode,
and while the request's adapter is still loading from disk. Each ends idle; a request
running beside the aborted one finishes exactly as it would alone."""
from __future__ import annotations

from pathlib import Path

from runtime.engine import LLMEngine
from runtime.request import SamplingParams
from tests.engine_helpers import run_alone, run_to_completion
from tests.faults.conftest import HeldLoadEngine, engine_config, idle_problems

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def step_until(engine: LLMEngine, predicate, max_steps: int = 200) -> list:
    """Step until ``predicate(outputs of that step)``; returns every output seen."""
    seen = []
    for _ in range(max_steps):
        outs = engine.step()
        seen += outs
        if predicate(outs):
            return seen
    raise AssertionError("condition not reached")


def test_abort_during_prefill_and_decode(tiny_llama_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    # A small token budget makes a 60-token prompt take several prefill steps.
    engine = LLMEngine(engine_config(tiny_llama_dir, max_num_batched_tokens=16))
    for name in ("a", "b"):
        engine.register_adapter(name, str(tiny_adapters[name]))
    long_prompt = list(range(1, 61))
    bystander = run_alone(engine, "alone", list(range(100, 120)), GREEDY, "b")

    engine.add_request("prefill", long_prompt, GREEDY, "a")
    engine.add_request("keep", list(range(100, 120)), GREEDY, "b")
    outs = engine.step()
    assert not any(o.request_id == "prefill" for o in outs)  # nothing sampled yet: still in prefill
    snap = engine.snapshot()
    assert snap["kv_blocks_free"] < snap["kv_blocks_total"] and snap["total_refcounts"]["adapter_demand"] == 2
    assert engine.abort("prefill")

    engine.add_request("decode", long_prompt, GREEDY, "a")
    seen = step_until(engine, lambda outs: any(o.request_id == "decode" and len(o.token_ids) >= 3 for o in outs))
    assert not any(o.finished for o in seen if o.request_id == "decode")
    assert engine.abort("decode")
    assert not engine.abort("decode")  # a second abort finds nothing

    finals = {o.request_id: o for o in seen if o.finished}
    finals.update(run_to_completion(engine))
    assert finals["prefill"].finish_reason == "abort" and finals["decode"].finish_reason == "abort"
    assert finals["keep"].token_ids == bystander.token_ids and finals["keep"].text == bystander.text
    assert idle_problems(engine.snapshot(), registered=2) == []
    engine.close()


def test_abort_and_unload_while_adapter_is_loading(tiny_llama_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    # Host tier of 2: registering a third adapter pushes "a" out, so its next use reads the disk.
    engine = HeldLoadEngine(engine_config(tiny_llama_dir, max_cpu_loras=2))
    try:
        for name in ("a", "b", "c"):
            engine.register_adapter(name, str(tiny_adapters[name]))
        engine.add_request("waits-for-a", [5, 6, 7, 8], GREEDY, "a")
        assert engine.load_started.wait(10)
        assert engine.snapshot()["pool"]["loads_in_flight"] == 1
        assert engine.abort("waits-for-a")
        engine.load_gate.set()
        engine.pool.wait_for_load(timeout=10)
        run_to_completion(engine)
        assert idle_problems(engine.snapshot(), registered=3) == []
        # The load finished after its only reader left; the adapter still serves, from the host.
        out = run_alone(engine, "later", [5, 6, 7, 8], GREEDY, "a")
        assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_tokens

        # Now unload the adapter while its load is in flight: the loaded copy must be dropped.
        engine.load_gate.clear()
        engine.load_started.clear()
        engine.register_adapter("d", str(tiny_adapters["d"]))  # pushes another adapter out of the host
        evicted = next(n for n in ("a", "b", "c") if all(r.name != n for r in engine.pool.host_refs()))
        engine.add_request("waits-again", [9, 10], GREEDY, evicted)
        assert engine.load_started.wait(10)
        assert engine.abort("waits-again")
        engine.unregister_adapter(evicted)
        engine.load_gate.set()
        engine.pool.wait_for_load(timeout=10)
        run_to_completion(engine)
        assert idle_problems(engine.snapshot(), registered=3) == []
        assert all(r.name != evicted for r in engine.pool.host_refs())
    finally:
        engine.load_gate.set()
        engine.close()
