"""Sampling end to end through LLMEngine (the other engine tests are all greedy).

- without a per-request seed, the engine's ``EngineConfig.seed`` decides the draws: the same
  seed reproduces a run exactly, another seed changes it;
- a request's own ``seed`` gives the same tokens alone and inside a mixed batch;
- ``top_k=1`` at temperature > 0 is greedy.

Everything is fp32 on the CPU with fixed seeds, so every assertion is deterministic. The
"differs" assertions compare many sampled tokens over a 300-token vocabulary; a chance
collision of whole sequences is astronomically unlikely.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from runtime.request import SamplingParams
from tests.engine_helpers import make_engine, random_prompt, run_alone, run_to_completion

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
HOT = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, ignore_eos=True)  # no seed: drawn from the engine's


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, rng.randint(3, 12)) for _ in range(n)]


def _engine_run(model_dir, adapters, engine_seed: int, prompts, params: SamplingParams) -> list[tuple[int, ...]]:
    """One fresh engine with ``EngineConfig.seed=engine_seed``; all prompts submitted together, in order."""
    engine = make_engine(model_dir, seed=engine_seed)
    names = sorted(adapters)
    for name in names:
        engine.register_adapter(name, str(adapters[name]))
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params, names[i % len(names)] if i % 2 else None)
        finals = run_to_completion(engine)
    finally:
        engine.close()
    assert all(finals[f"r{i}"].finish_reason == "length" for i in range(len(prompts)))
    return [finals[f"r{i}"].token_ids for i in range(len(prompts))]


def test_engine_seed_decides_unseeded_sampling(tiny_llama_dir, tiny_adapters):
    prompts = _prompts(4)
    first = _engine_run(tiny_llama_dir, tiny_adapters, 11, prompts, HOT)
    again = _engine_run(tiny_llama_dir, tiny_adapters, 11, prompts, HOT)
    other = _engine_run(tiny_llama_dir, tiny_adapters, 12, prompts, HOT)
    greedy = _engine_run(tiny_llama_dir, tiny_adapters, 11, prompts, GREEDY)
    assert first == again, "the same EngineConfig.seed must reproduce unseeded sampling exactly"
    assert first != other, "a different EngineConfig.seed must change unseeded sampling (is the seed ignored?)"
    # Per request too: every request draws its own seed from the engine's seed source.
    assert all(a != b for a, b in zip(first, other)), "each unseeded request should get a seed-dependent draw"
    assert first != greedy and other != greedy, "temperature 0.8 must not decode greedily"


def test_seeded_request_is_independent_of_its_batch(tiny_llama_dir, tiny_adapters):
    engine = make_engine(tiny_llama_dir, seed=5)
    names = sorted(tiny_adapters)
    for name in names:
        engine.register_adapter(name, str(tiny_adapters[name]))
    prompt = _prompts(1, seed=9)[0]
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    for adapter in (None, names[0]):
        alone = run_alone(engine, f"alone-{adapter}", prompt, seeded, adapter).token_ids
        # The same request inside a batch with sampled (seeded, unseeded, top-k) and greedy
        # neighbours, with and without adapters, some sharing its prompt.
        neighbours = [
            (GREEDY, None), (GREEDY, names[1]), (HOT, None), (HOT, names[0]),
            (SamplingParams(max_tokens=5, temperature=1.2, seed=7, ignore_eos=True), names[2]),
            (SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=8, ignore_eos=True), adapter),
            (SamplingParams(max_tokens=3, temperature=0.7, top_k=5, ignore_eos=True), None),
        ]
        rng = random.Random(1)
        for i, (params, ad) in enumerate(neighbours[:3]):
            engine.add_request(f"n{i}-{adapter}", random_prompt(rng, rng.randint(2, 15)), params, ad)
        engine.add_request(f"target-{adapter}", prompt, seeded, adapter)
        for i, (params, ad) in enumerate(neighbours[3:], start=3):
            p = prompt if i == 5 else random_prompt(rng, rng.randint(2, 15))
            engine.add_request(f"n{i}-{adapter}", p, params, ad)
        finals = run_to_completion(engine)
        assert finals[f"target-{adapter}"].token_ids == alone, f"seeded request (adapter {adapter}) changed inside a batch"
        other_seed = finals[f"n5-{adapter}"].token_ids  # same prompt, adapter and params, seed 8
        assert other_seed != alone, "seed 7 and seed 8 drew the same tokens: is the request's seed/temperature honoured?"
        greedy = run_alone(engine, f"greedy-{adapter}", prompt, GREEDY, adapter).token_ids
        assert alone != greedy, "temperature 0.9 decoded greedily"
    engine.close()


def test_top_k_one_is_greedy_at_any_temperature(tiny_llama_dir, tiny_adapters):
    engine = make_engine(tiny_llama_dir, seed=2)
    name = sorted(tiny_adapters)[0]
    engine.register_adapter(name, str(tiny_adapters[name]))
    prompts = _prompts(3, seed=4)
    differs = False
    for i, prompt in enumerate(prompts):
        adapter = name if i % 2 else None
        greedy = run_alone(engine, f"g{i}", prompt, GREEDY, adapter).token_ids
        for seed in (0, 1):
            top1 = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, top_k=1, seed=seed, ignore_eos=True)
            assert run_alone(engine, f"k{i}-{seed}", prompt, top1, adapter).token_ids == greedy
            # Control: without top_k the same temperature and seed leave greedy decoding.
            hot = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, seed=seed, ignore_eos=True)
            differs |= run_alone(engine, f"h{i}-{seed}", prompt, hot, adapter).token_ids != greedy
    assert differs, "temperature 1.5 without top_k always matched greedy: is temperature honoured?"
    engine.close()


def test_tiny_temperature_decodes_greedily(tiny_llama_dir, tiny_adapters):
    """temperature 1e-40 (valid in the API's 0..2 range) used to overflow the float32 logits and
    make ``torch.multinomial`` raise, killing the engine; below 1e-5 it is greedy now."""
    engine = make_engine(tiny_llama_dir, seed=1)
    name = sorted(tiny_adapters)[0]
    engine.register_adapter(name, str(tiny_adapters[name]))
    for i, prompt in enumerate(_prompts(2, seed=6)):
        adapter = name if i else None
        greedy = run_alone(engine, f"g{i}", prompt, GREEDY, adapter).token_ids
        tiny = SamplingParams(max_tokens=MAX_TOKENS, temperature=1e-40, ignore_eos=True)
        out = run_alone(engine, f"t{i}", prompt, tiny, adapter)
        assert out.finish_reason == "length" and out.token_ids == greedy
    engine.close()


def test_non_finite_logits_end_only_that_request(tiny_llama_dir, tiny_adapters, monkeypatch):
    """A row of NaN logits ends its own request with an error; the other rows of the step keep
    their tokens and the engine serves the next request normally."""
    engine = make_engine(tiny_llama_dir, seed=1)
    prompts = _prompts(3, seed=8)
    want = [run_alone(engine, f"ref{i}", p, GREEDY, None).token_ids for i, p in enumerate(prompts)]
    real_execute = engine.runner.execute
    poisoned: list[int] = []

    def execute(steps):
        logits = real_execute(steps)
        if not poisoned:  # the first step: poison the second sampled row
            poisoned.append(1)
            logits = logits.clone()
            logits[1, 5] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "execute", execute)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY, None)
    finals = run_to_completion(engine)
    assert finals["r1"].finish_reason == "error" and "non-finite logits" in finals["r1"].error and finals["r1"].token_ids == ()
    assert [finals["r0"].token_ids, finals["r2"].token_ids] == [want[0], want[2]]
    assert finals["r0"].finish_reason == finals["r2"].finish_reason == "length"
    assert run_alone(engine, "after", prompts[1], GREEDY, None).token_ids == want[1]
    snap = engine.snapshot()
    assert snap["kv_blocks_free"] == snap["kv_blocks_total"]
    engine.close()


def test_numpy_scalars_are_the_numbers_they_equal():
    """``SamplingParams(max_tokens=np.int64(8), temperature=np.float32(0.5))`` (a sweep over
    ``np.arange``) was refused with "must be an integer >= 0, got np.int64(8)"; the offline API
    takes numpy integers as token ids, and here they are stored as plain ints and floats."""
    params = SamplingParams(max_tokens=np.int64(8), temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int32(4),
                            seed=np.uint64(2**63), logprobs=np.int8(2), min_tokens=np.int64(1), stop_token_ids=[np.int64(7)],
                            logit_bias={np.int64(3): np.float32(-2.0)}, repetition_penalty=np.float32(1.5))  # fmt: skip
    plain = SamplingParams(max_tokens=8, temperature=0.5, top_p=0.9, top_k=4, seed=2**63, logprobs=2, min_tokens=1, stop_token_ids=[7],
                           logit_bias={3: -2.0}, repetition_penalty=1.5)  # fmt: skip
    assert params == plain and hash(params) == hash(plain)
    assert all(type(getattr(params, f)) is type(getattr(plain, f)) for f in ("max_tokens", "temperature", "top_k", "seed", "logprobs"))
    assert type(params.stop_token_ids[0]) is int and type(params.logit_bias[0][0]) is int
    with pytest.raises(ValueError, match="max_tokens: must be an integer"):
        SamplingParams(max_tokens=np.float64(8.0))  # a float stays refused as an integer field
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=np.bool_(True))


@pytest.mark.parametrize("bias", [[1, 2], {1: 2.0, "a": 3.0}, [(1, 2.0, 3)], [[1]], [None], {-1: 1.0}])
def test_a_malformed_logit_bias_is_a_value_error_naming_the_field(bias):
    """``logit_bias=[1, 2]`` raised TypeError "'int' object is not iterable", and a dict with keys of
    mixed types TypeError "'<' not supported between instances of 'str' and 'int'"."""
    with pytest.raises(ValueError, match="logit_bias: must map"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_is_stored_in_one_order_whatever_its_form():
    forms = [{5: 1.0, 2: -1.0}, [(5, 1.0), (2, -1.0)], ((5, 1.0), (2, -1.0)), [[5, 1.0], [2, -1.0]], ([5, 1.0], (2, -1.0))]
    assert {SamplingParams(logit_bias=f).logit_bias for f in forms} == {((2, -1.0), (5, 1.0))}


def test_top_k_minus_one_is_off_as_in_vllm_and_the_http_api():
    """The HTTP API (docs/api.md) and vLLM take top_k=-1 for off; SamplingParams refused it."""
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0) == SamplingParams()
    assert SamplingParams(top_k=np.int64(-1)).top_k == 0
    for bad in (-2, True, 1.0):
        with pytest.raises(ValueError, match=r"top_k: must be an integer >= 0, or -1"):
            SamplingParams(top_k=bad)
