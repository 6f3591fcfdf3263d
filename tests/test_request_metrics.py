"""Per-request metrics and pool counters: TPOT from token times, registration reads counted as
loads, and prompt tokens counted only for requests that reached the model."""
from __future__ import annotations

import random

from prometheus_client import generate_latest

from runtime.request import SamplingParams, Sequence
from runtime.server.metrics import ServerMetrics
from runtime.stats import RequestMetrics
from tests.engine_helpers import make_engine, random_prompt


def _seq(**times) -> Sequence:
    seq = Sequence("r", 0, [5, 6, 7], SamplingParams(max_tokens=8), None, arrival_time=10.0)
    for key, value in times.items():
        setattr(seq, key, value)
    return seq


def test_tpot_is_measured_between_the_first_and_last_token_not_to_the_finish():
    seq = _seq(first_scheduled_time=10.5, first_token_time=11.0, last_token_time=11.6, finished_time=19.0)
    seq.output_token_ids = [1, 2, 3, 4]  # 3 gaps over 0.6 s; the abort 7.4 s later adds nothing
    m = RequestMetrics.of(seq)
    assert abs(m.tpot - 0.2) < 1e-12 and abs(m.ttft - 1.0) < 1e-12 and abs(m.queue_time - 0.5) < 1e-12
    one = _seq(first_token_time=11.0, last_token_time=11.0, finished_time=12.0)
    one.output_token_ids = [1]
    assert RequestMetrics.of(one).tpot is None


def test_engine_stamps_the_last_token_time(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    seen: list[RequestMetrics] = []
    engine.add_observer(seen.append)
    engine.add_request("r", random_prompt(random.Random(1), 6), SamplingParams(max_tokens=5, ignore_eos=True), None)
    seq = engine._live["r"].seq
    for _ in range(3):
        engine.step()
    assert len(seq.output_token_ids) == 3 and seq.first_token_time <= seq.last_token_time
    stamped = seq.last_token_time
    engine.abort("r")
    engine.step()
    assert seq.finished_time >= stamped and seq.last_token_time == stamped
    assert seen[0].finish_reason == "abort" and seen[0].tpot == (stamped - seq.first_token_time) / 2
    engine.close()


def test_registration_read_counts_as_a_host_load(tiny_llama_dir, tiny_adapters):
    engine = make_engine(tiny_llama_dir, max_cpu_loras=4)
    name = sorted(tiny_adapters)[0]
    engine.register_adapter(name, str(tiny_adapters[name]))
    assert engine.snapshot()["adapters"][name]["loads"] == 1
    engine.add_request("r", random_prompt(random.Random(2), 5), SamplingParams(max_tokens=2, ignore_eos=True), name)
    while engine.has_unfinished():
        engine.step()
    counters = engine.snapshot()["adapters"][name]
    assert counters["loads"] == 1 and counters["host_hits"] == 1 and counters["disk_misses"] == 0  # read once, at registration
    engine.close()


def test_prompt_tokens_metric_skips_requests_that_never_ran():
    metrics = ServerMetrics(lambda: {})
    ran = RequestMetrics("a", None, None, queue_time=0.1, ttft=0.2, tpot=None, prompt_tokens=7, output_tokens=1,
                         preemptions=0, adapter_location="none", finish_reason="length")
    never = RequestMetrics("b", None, None, queue_time=None, ttft=None, tpot=None, prompt_tokens=50, output_tokens=0,
                           preemptions=0, adapter_location="none", finish_reason="abort")
    metrics.observe(ran)
    metrics.observe(never)
    text = generate_latest(metrics.registry).decode()
    assert 'lorafleet_prompt_tokens_total{adapter="__base__"} 7.0' in text
    assert 'lorafleet_requests_total{adapter="__base__",finish_reason="abort"} 1.0' in text


def test_preemptions_and_prefix_cache_figures_reach_metrics(tiny_llama_dir):
    """KV pressure shows in /metrics: each preemption counted once (as the requests' own counts
    add up), and the prefix cache's figures once per request: three distinct prompts of 9 tokens
    look up 2 blocks each and hit none, however often they are preempted and readmitted."""
    engine = make_engine(tiny_llama_dir, num_kv_blocks=6, block_size=4, enable_prefix_caching=True, max_model_len=24)
    metrics = ServerMetrics(engine.snapshot)
    seen: list[RequestMetrics] = []
    engine.add_observer(seen.append)
    for i in range(3):
        engine.add_request(f"r{i}", [10 * i + t + 1 for t in range(9)], SamplingParams(max_tokens=6, ignore_eos=True), None)
    while engine.has_unfinished():
        engine.step()
    made = sum(m.preemptions for m in seen)
    assert made > 0, "the 6-block pool should force preemption"
    text = metrics.render().decode()
    assert "# TYPE lorafleet_preemptions_total counter" in text
    assert f"lorafleet_preemptions_total {float(made)}" in text
    assert "lorafleet_prefix_cache_queried_blocks_total 6.0" in text
    assert "lorafleet_prefix_cache_hit_blocks_total 0.0" in text
    engine.close()


def test_snapshot_counters_carry_the_replica_label():
    snaps = {"r0": {"preemptions": 2, "prefix_cache_queried_blocks": 5, "prefix_cache_hit_blocks": 3}, "r1": {"preemptions": 1}}
    text = ServerMetrics(lambda: {}, replica_snapshots=lambda: snaps).render().decode()
    assert 'lorafleet_preemptions_total{replica="r0"} 2.0' in text and 'lorafleet_preemptions_total{replica="r1"} 1.0' in text
    assert 'lorafleet_prefix_cache_hit_blocks_total{replica="r0"} 3.0' in text and 'lorafleet_prefix_cache_hit_blocks_total{replica="r1"} 0.0' in text
