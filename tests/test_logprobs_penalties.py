"""Logprobs and the presence / frequency / repetition penalties, engine and sampler.

References: transformers + PEFT, independent of lorafleet's model code. Logprobs are compared
with ``log_softmax`` (float64) of PEFT's logits at each generated position; the repetition
penalty with PEFT's own ``generate(repetition_penalty=...)``; presence and frequency penalties
(which transformers does not implement) with a greedy loop over PEFT's logits that applies
OpenAI's formula in float64. Batches mix adapters of different ranks with base-model rows.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from runtime.request import MAX_LOGPROBS, SamplingParams
from runtime.sampler import EVERY_TOKEN_BANNED, NON_FINITE_LOGITS, Sampler, penalize_rows_
from tests.engine_helpers import make_engine, random_prompt, run_to_completion
from tests.test_peft_match import peft_model

ADAPTERS = ["a", "b", None, "c", None]  # None: the base model
PROMPT_LEN = 9
NEW_TOKENS = 6


def engine_with_adapters(model_dir, adapters):
    engine = make_engine(model_dir, max_loras=4, max_cpu_loras=4, num_kv_blocks=128)
    for name in sorted({n for n in ADAPTERS if n is not None}):
        engine.register_adapter(name, str(adapters[name]))
    return engine


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tiny_adapters):
    return peft_model(tiny_llama_dir, {n: tiny_adapters[n] for n in ADAPTERS if n is not None})


def peft_log_softmax(model, prompt: list[int], output: list[int], adapter) -> torch.Tensor:
    """float64 log_softmax of PEFT's logits for each generated position: [len(output), vocab]."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids, adapter_names=[adapter or "__base__"]).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1 :], dim=-1)


def test_logprobs_match_peft_for_greedy_and_sampled_rows(tiny_llama_dir, tiny_adapters, reference):
    rng = random.Random(5)
    engine = engine_with_adapters(tiny_llama_dir, tiny_adapters)
    requests = {}
    for i, adapter in enumerate(ADAPTERS):
        # Sampled rows at temperature 0.7: logprobs are the model's, not the tempered distribution's.
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5, temperature=0.0 if i % 2 == 0 else 0.7, seed=i)
        requests[f"r{i}"] = (random_prompt(rng, PROMPT_LEN), adapter, params)
        engine.add_request(f"r{i}", requests[f"r{i}"][0], params, adapter)
    finals = run_to_completion(engine)
    for rid, (prompt, adapter, params) in requests.items():
        out = finals[rid]
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == NEW_TOKENS
        ref = peft_log_softmax(reference, prompt, list(out.token_ids), adapter)
        for pos, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(ref[pos, token].item(), abs=1e-4), (rid, pos)
            top_ref = torch.topk(ref[pos], 5)
            assert [t for t, _ in lp.top] == top_ref.indices.tolist(), (rid, pos)
            assert [v for _, v in lp.top] == pytest.approx(top_ref.values.tolist(), abs=1e-4)
            if params.greedy:
                assert lp.top[0][0] == token


def test_streamed_outputs_carry_the_new_tokens_logprobs(tiny_llama_dir, tiny_adapters):
    engine = engine_with_adapters(tiny_llama_dir, tiny_adapters)
    engine.add_request("lp", random_prompt(random.Random(1), PROMPT_LEN), SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0), "a")
    engine.add_request("plain", random_prompt(random.Random(2), PROMPT_LEN), SamplingParams(max_tokens=4, ignore_eos=True), "b")
    seen = {"lp": [], "plain": []}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert all(o.logprobs is None and o.new_logprobs is None for o in seen["plain"])
    streamed = [lp for o in seen["lp"] for lp in o.new_logprobs]
    assert [lp.token_id for lp in streamed] == list(seen["lp"][-1].token_ids)
    assert all(lp.top == () and lp.logprob <= 0 for lp in streamed)  # logprobs=0: the token only


def greedy_with_openai_penalties(model, prompt, adapter, presence: float, frequency: float) -> list[int]:
    out: list[int] = []
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            z = model(input_ids=torch.tensor([prompt + out]), adapter_names=[adapter or "__base__"]).logits[0, -1].double().tolist()
        for token in set(out):
            z[token] -= frequency * out.count(token) + presence
        out.append(max(range(len(z)), key=lambda j: (z[j], -j)))
    return out


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 2.0), (-1.0, 0.7)])
def test_presence_and_frequency_penalties_match_openais_formula(tiny_llama_dir, tiny_adapters, reference, presence, frequency):
    rng = random.Random(11)
    prompts = [random_prompt(rng, PROMPT_LEN) for _ in ADAPTERS]
    engine = engine_with_adapters(tiny_llama_dir, tiny_adapters)
    for i, (prompt, adapter) in enumerate(zip(prompts, ADAPTERS)):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, presence_penalty=presence,
                                                           frequency_penalty=frequency), adapter)  # fmt: skip
        engine.add_request(f"u{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), adapter)
    finals = run_to_completion(engine)
    for i, (prompt, adapter) in enumerate(zip(prompts, ADAPTERS)):
        assert list(finals[f"p{i}"].token_ids) == greedy_with_openai_penalties(reference, prompt, adapter, presence, frequency), i
    # The penalties change something here, or this test could not fail.
    assert any(finals[f"p{i}"].token_ids != finals[f"u{i}"].token_ids for i in range(len(ADAPTERS)))


def test_repetition_penalty_matches_transformers_generate(tiny_llama_dir, tiny_adapters, reference):
    rng = random.Random(13)
    prompts = [random_prompt(rng, PROMPT_LEN) for _ in ADAPTERS]
    engine = engine_with_adapters(tiny_llama_dir, tiny_adapters)
    for i, (prompt, adapter) in enumerate(zip(prompts, ADAPTERS)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.8), adapter)
        engine.add_request(f"u{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), adapter)
    finals = run_to_completion(engine)
    ids = torch.tensor(prompts)
    with torch.no_grad():
        ref = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=[a or "__base__" for a in ADAPTERS],
                                 max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)  # fmt: skip
    for i in range(len(ADAPTERS)):
        assert list(finals[f"r{i}"].token_ids) == ref[i, PROMPT_LEN:].tolist(), i
    assert any(finals[f"r{i}"].token_ids != finals[f"u{i}"].token_ids for i in range(len(ADAPTERS)))


def test_penalized_logits_formula():
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(12, generator=gen) * 3
    params = SamplingParams(presence_penalty=0.4, frequency_penalty=-0.3, repetition_penalty=1.7)
    prompt, output = [1, 5, 5, 11], [5, 7, 7, 7, 0]
    rows = torch.stack([torch.randn(12, generator=gen), z, torch.randn(12, generator=gen)])
    untouched = rows[[0, 2]].clone()
    penalize_rows_(rows, [1], [params], [torch.tensor(prompt)], [output])  # the middle row only
    ours = rows[1].double()
    assert torch.equal(rows[[0, 2]], untouched)
    expected = z.double().tolist()
    for j in set(prompt) | set(output):
        expected[j] = expected[j] / 1.7 if expected[j] > 0 else expected[j] * 1.7
    for j in set(output):
        expected[j] -= -0.3 * output.count(j) + 0.4
    assert ours.tolist() == pytest.approx(expected, abs=1e-5)


def test_logit_bias_comes_before_the_repetition_penalty():
    """vLLM's order: logit_bias, then the penalties. Token 0 (logit 1, seen) with bias 2 and
    repetition_penalty 2 becomes (1 + 2) / 2 = 1.5 and loses to token 1 (logit 2, unseen); biased
    after the penalty it would be 1 / 2 + 2 = 2.5 and win. Greedy and a top_k=1 sampled row agree."""
    logits = torch.tensor([[1.0, 2.0, -1.0]] * 2)
    params = [SamplingParams(logit_bias={0: 2.0}, repetition_penalty=2.0, temperature=t, top_k=k, seed=1) for t, k in ((0.0, 0), (1.0, 1))]
    sampler = Sampler()
    for rid, p in zip("ab", params):
        sampler.add(rid, p)
    assert sampler.sample(logits, ["a", "b"], params, [([0], []), ([0], [])]) == [1, 1]


def test_sampler_logprobs_rows():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    logits[2] = float("nan")
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(logprobs=2), SamplingParams(logprobs=MAX_LOGPROBS)]
    sampler = Sampler()
    tokens = sampler.sample(logits, ["a", "b", "c", "d"], params)
    assert tokens[2] == NON_FINITE_LOGITS
    out = Sampler.logprobs(logits, tokens, params)
    assert out[1] is None and out[2] is None  # not asked for; no token
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out[0].logprob == pytest.approx(ref[0, tokens[0]].item(), abs=1e-6) and len(out[0].top) == 3
    assert len(out[3].top) == 10  # at most the vocabulary
    assert math.fsum(math.exp(v) for _, v in out[3].top) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("repetition_penalty", [5e-324, 1e-300, 1e-45, 3e38, 1e300])
def test_extreme_repetition_penalties_keep_every_row_samplable(repetition_penalty):
    """A repetition penalty far outside float32's range (a fuzzed 1e-300 once put +inf, then NaN, in
    a row and failed the engine step) still gives each row a token, picked as the limit says:
    r -> 0 pushes the seen tokens with positive logits above all others, r -> inf pushes every
    seen token below the best unseen one (here positive)."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 40, generator=gen) * 4
    prompt, output = [3, 4, 5, 6, 7, 8], [9, 10]
    logits[:, 3], logits[:, 30] = 5.0, 50.0  # a seen positive token; an unseen one that leads
    params = [SamplingParams(repetition_penalty=repetition_penalty, temperature=t, seed=1) for t in (0.0, 1.0, 0.0, 1.0)]
    ids = ["a", "b", "c", "d"]
    sampler = Sampler()
    for rid, p in zip(ids, params):
        sampler.add(rid, p)
    tokens = sampler.sample(logits, ids, params, [(prompt, output)] * 4)
    assert all(isinstance(t, int) for t in tokens), tokens
    if repetition_penalty < 1:
        assert all(t in prompt + output and logits[row, t] > 0 for row, t in enumerate(tokens)), tokens
    else:
        assert tokens[0] == tokens[2] == 30  # greedy: the best unseen token


def test_a_row_whose_adjustments_ban_every_token_fails_alone():
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(5))
    ban_all = SamplingParams(min_tokens=2, stop_token_ids=tuple(range(6)), temperature=1.0, seed=3)
    params = [ban_all, SamplingParams()]
    sampler = Sampler(eos_token_ids=(0,))
    for rid, p in zip("ab", params):
        sampler.add(rid, p)
    assert sampler.sample(logits, ["a", "b"], params, [([1], []), ([1], [])]) == [EVERY_TOKEN_BANNED, int(logits[1].argmax())]


def test_penalties_without_histories_are_refused():
    with pytest.raises(ValueError, match="histories"):
        Sampler().sample(torch.zeros(1, 4), ["a"], [SamplingParams(presence_penalty=1.0)])


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("presence_penalty", float("nan")), ("frequency_penalty", True),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", True), ("logprobs", 2.0), ("prompt_logprobs", -1),
    ("prompt_logprobs", MAX_LOGPROBS + 1), ("prompt_logprobs", False), ("seed", 2**64), ("seed", -1),
])  # fmt: skip
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def peft_prompt_log_softmax(model, prompt: list[int], adapter) -> torch.Tensor:
    """float64 log_softmax of PEFT's logits at prompt positions 0 .. P-2 (predicting tokens 1 .. P-1)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt]), adapter_names=[adapter or "__base__"]).logits[0].double()
    return torch.log_softmax(logits[:-1], dim=-1)


@pytest.mark.parametrize("budget, prefix_caching", [(8, False), (64, True)])
def test_prompt_logprobs_match_peft(tiny_llama_dir, tiny_adapters, reference, budget, prefix_caching):
    """Chunked prefill (8-token budget: chunks of every size, 1 included), and prefix caching with a
    repeated prompt (which must not skip the positions it would have reused)."""
    rng = random.Random(21)
    engine = make_engine(tiny_llama_dir, max_loras=4, max_cpu_loras=4, num_kv_blocks=128, max_num_batched_tokens=budget,
                         enable_prefix_caching=prefix_caching)  # fmt: skip
    for name in sorted({n for n in ADAPTERS if n is not None}):
        engine.register_adapter(name, str(tiny_adapters[name]))
    prompts = [random_prompt(rng, rng.randrange(5, 21)) for _ in ADAPTERS]
    jobs = list(zip(prompts, ADAPTERS)) + [(prompts[0], ADAPTERS[0])]  # the repeat: a prefix-cache hit without prompt logprobs
    for i, (prompt, adapter) in enumerate(jobs):
        engine.add_request(f"warm{i}", prompt, SamplingParams(max_tokens=2, ignore_eos=True), adapter)
    run_to_completion(engine)  # the cache now holds these prompts' blocks
    for i, (prompt, adapter) in enumerate(jobs):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2, logprobs=1), adapter)
    finals = run_to_completion(engine)
    for i, (prompt, adapter) in enumerate(jobs):
        out = finals[f"r{i}"]
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        ref = peft_prompt_log_softmax(reference, prompt, adapter)
        for p, entry in enumerate(out.prompt_logprobs[1:]):
            assert entry.token_id == prompt[p + 1]
            assert entry.logprob == pytest.approx(ref[p, prompt[p + 1]].item(), abs=1e-4), (i, p)
            assert [t for t, _ in entry.top] == torch.topk(ref[p], 2).indices.tolist(), (i, p)
        assert len(out.logprobs) == 3
    assert all(o.prompt_logprobs is None for rid, o in finals.items() if rid.startswith("warm"))


def test_prompt_logprobs_survive_preemption(tiny_llama_dir, tiny_adapters, reference):
    """A KV pool too small for every request at once: preempted requests are prefilled again and
    must neither lose nor repeat prompt entries."""
    rng = random.Random(22)
    engine = make_engine(tiny_llama_dir, max_loras=4, max_cpu_loras=4, num_kv_blocks=14, block_size=4, max_num_batched_tokens=16)
    for name in sorted({n for n in ADAPTERS if n is not None}):
        engine.register_adapter(name, str(tiny_adapters[name]))
    preemptions = []
    engine.add_observer(lambda metrics: preemptions.append(metrics.preemptions))
    prompts = [random_prompt(rng, 12) for _ in ADAPTERS]
    for i, (prompt, adapter) in enumerate(zip(prompts, ADAPTERS)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=10, ignore_eos=True, prompt_logprobs=1), adapter)
    finals = run_to_completion(engine)
    for i, (prompt, adapter) in enumerate(zip(prompts, ADAPTERS)):
        ref = peft_prompt_log_softmax(reference, prompt, adapter)
        entries = finals[f"r{i}"].prompt_logprobs[1:]
        assert [e.token_id for e in entries] == prompt[1:]
        assert [e.logprob for e in entries] == pytest.approx([ref[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)], abs=1e-4)
    assert sum(preemptions) > 0  # the case under test happened


def test_logit_bias_steers_every_row_it_is_given(tiny_llama_dir, tiny_adapters):
    """+100 on one token makes greedy decoding emit only it; -100 on the unbiased run's tokens
    bans them; other rows of the batch are untouched."""
    rng = random.Random(31)
    engine = engine_with_adapters(tiny_llama_dir, tiny_adapters)
    prompts = [random_prompt(rng, PROMPT_LEN) for _ in ADAPTERS]
    for i, (prompt, adapter) in enumerate(zip(prompts, ADAPTERS)):
        engine.add_request(f"u{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), adapter)
    plain = run_to_completion(engine)
    for i, (prompt, adapter) in enumerate(zip(prompts, ADAPTERS)):
        engine.add_request(f"up{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logit_bias={77: 100.0}), adapter)
        banned = {t: -100.0 for t in plain[f"u{i}"].token_ids}
        engine.add_request(f"down{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logit_bias=banned), adapter)
        engine.add_request(f"same{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), adapter)
    finals = run_to_completion(engine)
    for i in range(len(ADAPTERS)):
        assert finals[f"up{i}"].token_ids == (77,) * NEW_TOKENS
        assert not set(finals[f"down{i}"].token_ids) & set(plain[f"u{i}"].token_ids)
        assert finals[f"same{i}"].token_ids == plain[f"u{i}"].token_ids
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("bad", [1, 2], SamplingParams(logit_bias={10**6: 1.0}))
    vocab = engine.runner.model_config.vocab_size
    every_id = SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=list(range(vocab)))
    with pytest.raises(ValueError, match="min_tokens: .* cover the whole vocabulary"):
        engine.add_request("bans-all", [1, 2], every_id)
    engine.add_request("bans-all-but-one", [1, 2], SamplingParams(max_tokens=2, min_tokens=1, ignore_eos=True, stop_token_ids=list(range(1, vocab))))
    assert run_to_completion(engine)["bans-all-but-one"].token_ids[0] == 0


def test_min_tokens_holds_back_eos_and_stop_ids():
    logits = torch.zeros(3, 8)
    logits[:, 2] = 10.0  # eos, the favourite
    logits[:, 5] = 9.0  # a stop token id, second
    sampler = Sampler(eos_token_ids=(2,))
    params = [SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[5]), SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[5]),
              SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True)]  # fmt: skip
    histories = [([1], [3]), ([1], [3, 4]), ([1], [])]  # 1 generated (held back), 2 (free), 0 but eos ignored (eos allowed)
    assert sampler.sample(logits, ["a", "b", "c"], params, histories) == [0, 2, 2]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})


def test_a_prompt_logprobs_request_publishes_the_blocks_it_computes(tiny_llama_dir, tiny_adapters):
    """It reuses nothing (each position needs its logits) but leaves its prompt in the prefix cache."""
    engine = make_engine(tiny_llama_dir, max_loras=4, max_cpu_loras=4, num_kv_blocks=128, enable_prefix_caching=True)
    engine.register_adapter("a", str(tiny_adapters["a"]))
    prompt = random_prompt(random.Random(41), 17)
    engine.add_request("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0), "a")
    run_to_completion(engine)
    assert engine.snapshot()["prefix_cache_hit_blocks"] == 0
    engine.add_request("again", prompt, SamplingParams(max_tokens=1), "a")
    run_to_completion(engine)
    assert engine.snapshot()["prefix_cache_hit_blocks"] == (len(prompt) - 1) // 4  # block_size 4
    engine.add_request("scored again", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0), "a")
    out = run_to_completion(engine)["scored again"]
    assert len(out.prompt_logprobs) == len(prompt) and engine.snapshot()["prefix_cache_hit_blocks"] == (len(prompt) - 1) // 4


def test_token_logprobs_in_blocks_equal_one_pass():
    from runtime.sampler import LOGPROB_ROWS_PER_BLOCK, token_logprobs

    n = 2 * LOGPROB_ROWS_PER_BLOCK + 37
    logits = torch.randn(n + 5, 40, generator=torch.Generator().manual_seed(4))
    rows = list(range(3, n + 3))
    tokens = [(7 * r) % 40 for r in rows]
    ks = [r % 4 for r in rows]
    got = token_logprobs(logits, tokens, ks, rows)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert [e.token_id for e in got] == tokens
    assert [e.logprob for e in got] == pytest.approx([ref[r, t].item() for r, t in zip(rows, tokens)], abs=1e-5)
    assert [[t for t, _ in e.top] for e in got] == [torch.topk(ref[r], k).indices.tolist() for r, k in zip(rows, ks)]


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny_llama_dir, tiny_adapters):
    """max_tokens=0 computes (and with prompt_logprobs scores) the prompt and samples nothing:
    the same prompt logprobs as a 1-token request, no token, finish "length"; the other rows of
    the batch are as they would be alone, and the engine ends idle."""
    rng = random.Random(41)
    engine = engine_with_adapters(tiny_llama_dir, tiny_adapters)
    prompts = [random_prompt(rng, PROMPT_LEN + i) for i in range(len(ADAPTERS))]
    for i, (prompt, adapter) in enumerate(zip(prompts, ADAPTERS)):
        engine.add_request(f"one{i}", prompt, SamplingParams(max_tokens=1, prompt_logprobs=2), adapter)
        engine.add_request(f"gen{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), adapter)
    alone = run_to_completion(engine)
    for i, (prompt, adapter) in enumerate(zip(prompts, ADAPTERS)):
        engine.add_request(f"score{i}", prompt, SamplingParams(max_tokens=0, prompt_logprobs=2), adapter)
        engine.add_request(f"plain{i}", prompt, SamplingParams(max_tokens=0), adapter)  # prefill only
        engine.add_request(f"gen{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), adapter)
    finals = run_to_completion(engine)
    for i in range(len(ADAPTERS)):
        score = finals[f"score{i}"]
        assert score.token_ids == () and score.finish_reason == "length" and score.error is None
        ref = alone[f"one{i}"].prompt_logprobs
        assert [e and (e.token_id, [t for t, _ in e.top]) for e in score.prompt_logprobs] == [e and (e.token_id, [t for t, _ in e.top]) for e in ref]
        assert [e.logprob for e in score.prompt_logprobs[1:]] == pytest.approx([e.logprob for e in ref[1:]], abs=1e-5)  # another batch: float noise
        assert finals[f"plain{i}"].token_ids == () and finals[f"plain{i}"].finish_reason == "length"
        assert finals[f"gen{i}"].token_ids == alone[f"gen{i}"].token_ids
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prompt_only_requests_draw_no_seed_and_may_fill_a_step(tiny_llama_dir, tiny_adapters):
    """A max_tokens=0 request samples nothing, so it takes no seed from the engine's seed source
    (unseeded requests after it sample as they would without it), and a step whose sampled rows
    are all prompt-only is fine."""
    rng = random.Random(43)
    prompt = random_prompt(rng, PROMPT_LEN)
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)
    runs = []
    for with_prompt_only in (False, True):
        engine = engine_with_adapters(tiny_llama_dir, tiny_adapters)
        if with_prompt_only:
            for i in range(3):  # alone in their steps: every sampled row of those steps is prompt-only
                engine.add_request(f"only{i}", prompt, SamplingParams(max_tokens=0, prompt_logprobs=1 if i else None), ADAPTERS[i])
            only = run_to_completion(engine)
            assert all(o.token_ids == () and o.finish_reason == "length" for o in only.values())
        engine.add_request("draw", prompt, sampled, None)
        runs.append(run_to_completion(engine)["draw"].token_ids)
    assert runs[0] == runs[1]
