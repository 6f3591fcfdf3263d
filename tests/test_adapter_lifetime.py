"""A waiting request keeps its adapter version through an in-place update, even when another
adapter takes the version's only device slot: the host tier holds every device resident, so the
version's weights never have to be read again from a folder that now holds other content."""
from __future__ import annotations

import random
from pathlib import Path

from runtime.request import SamplingParams
from tests.engine_helpers import clone_adapter, copy_adapter, make_engine, random_prompt, run_alone, run_to_completion


def test_waiting_request_keeps_its_version_after_in_place_update_and_slot_loss(tiny_llama_dir, tiny_adapters, tmp_path):
    engine = make_engine(tiny_llama_dir, max_loras=1, max_cpu_loras=2)
    live = copy_adapter(Path(tiny_adapters["b"]), tmp_path / "live")
    v1 = engine.register_adapter("A", str(live))
    prompt = random_prompt(random.Random(4), 9)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = run_alone(engine, "warm", prompt, params, "A").token_ids  # A@v1 now on the device and the host
    engine.register_adapter("B", str(tiny_adapters["a"]))
    engine.register_adapter("C", str(tiny_adapters["c"]))  # host room: B goes, not A, which is on the device
    assert v1 in engine.pool.host_refs() and engine.pool.slot_of(v1) == 0
    engine.add_request("rc", prompt, params, "C")  # older: takes the only slot first, evicting A@v1 there
    engine.add_request("ra", prompt, params, "A")  # bound to A@v1
    clone_adapter(Path(tiny_adapters["b"]), live, seed=999)  # overwrite A's folder in place ...
    v2 = engine.register_adapter("A", str(live))  # ... and hot-update the name
    assert v2.version != v1.version
    finals = run_to_completion(engine)
    assert finals["rc"].finish_reason == "length"
    assert finals["ra"].finish_reason == "length" and finals["ra"].adapter == v1 and finals["ra"].token_ids == want
    # v1 was read once, at registration; ra needed no second read. (v2 found the host full of wanted versions.)
    assert engine.snapshot()["adapters"]["A"]["loads"] == 1
    assert v1 not in engine.pool.host_refs() and engine.pool.slot_of(v1) is None  # freed after its last reader
    after = run_alone(engine, "new", prompt, params, "A")
    assert after.adapter == v2 and after.token_ids != want and engine.snapshot()["adapters"]["A"]["loads"] == 2
    engine.close()


def test_a_version_retired_while_chosen_for_draining_stays_for_its_waiting_requests(tiny_llama_dir, tiny_adapters, tmp_path):
    """host_drain never drains a retired version (its folder may hold other content by then). One
    chosen while current and retired by an in-place hot update before the read that needed its room
    started stays on the host: the request still waiting for it finishes on it, with no second read."""
    engine = make_engine(tiny_llama_dir, max_loras=1, max_cpu_loras=1, max_num_seqs=1)
    engine.register_adapter("B", str(tiny_adapters["b"]))
    live = copy_adapter(Path(tiny_adapters["a"]), tmp_path / "A")
    v1 = engine.register_adapter("A", str(live))  # the one host entry: A@v1; B is on disk only
    prompt = random_prompt(random.Random(0), 9)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for request_id, name in (("ra1", "A"), ("ra2", "A"), ("rb", "B")):
        engine.add_request(request_id, prompt, params, name)  # rb's read waits for room: A@v1 is to be drained
    finals = {}
    while "ra1" not in finals:
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.pool.host_drain() == v1 and engine.pool.demand_of(v1) == 1  # ra2 waits for A@v1, which is to go
    clone_adapter(Path(tiny_adapters["a"]), live, seed=5)  # overwrite A's folder in place ...
    v2 = engine.register_adapter("A", str(live))  # ... and hot-update the name: v1 retired
    finals.update(run_to_completion(engine))
    assert finals["ra2"].finish_reason == "length" and finals["ra2"].adapter == v1, finals["ra2"].error
    assert finals["ra2"].token_ids == finals["ra1"].token_ids
    assert finals["rb"].finish_reason == "length"
    assert engine.snapshot()["adapters"]["A"]["loads"] == 1  # v1 never read again (v2 found the host full)
    assert v1 not in engine.pool.host_refs()  # freed after its last reader
    assert run_alone(engine, "new", prompt, params, "A").adapter == v2
    engine.close()


def test_registry_dates_a_version_when_it_becomes_current(monkeypatch):
    """``AdapterInfo.registered_at``: set when a version becomes the name's current one; registering
    the current version again keeps it; a new version gets a new time."""
    import runtime.lora.registry as registry_module
    from runtime.lora.registry import AdapterRegistry
    from runtime.request import AdapterRef

    clock = iter([100.0, 200.0, 300.0])
    monkeypatch.setattr(registry_module.time, "time", lambda: next(clock))
    registry = AdapterRegistry()
    v1, v2 = AdapterRef("a", "1" * 64), AdapterRef("a", "2" * 64)
    registry.register(v1, "/a", 8)
    registry.register(v1, "/a-moved", 8)  # the same content again: still dated 100
    assert [(i.path, i.registered_at) for i in registry.infos()] == [("/a-moved", 100.0)]
    registry.register(v2, "/a", 8)
    assert [(i.version, i.registered_at) for i in registry.infos()] == [(v2.version, 200.0)]
