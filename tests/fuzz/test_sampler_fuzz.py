"""Sampler adjustments on random batches vs a plain-Python float64 reference.

Each row gets random logits and a random mix of logit_bias, min_tokens (with eos and
stop_token_ids), presence / frequency / repetition penalties and history; greedy picks must
equal the argmax of the reference's adjusted logits, and logprobs must be the raw logits'
log_softmax. Rows without adjustments ride in the same batch. And the sampled path's
temperature, top_k and top_p keep the tokens transformers' warpers keep, on coarse logits full of ties.
"""
from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.request import SamplingParams
from runtime.sampler import Sampler, filtered_logits

VOCAB = 12
EOS = 11


def reference_logits(z: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """The documented order, one token at a time: logit_bias, min_tokens, repetition, frequency, presence."""
    z = [float(v) for v in z]
    for token, bias in p.logit_bias:
        z[token] += bias
    if len(output) < p.min_tokens:
        for token in set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS}):
            z[token] = -math.inf
    if p.repetition_penalty != 1:
        for token in set(prompt) | set(output):
            z[token] = z[token] / p.repetition_penalty if z[token] > 0 else z[token] * p.repetition_penalty
    for token in set(output):
        z[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return z


tokens = st.integers(0, VOCAB - 1)
row = st.fixed_dictionaries({
    "logits": st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=VOCAB, max_size=VOCAB),
    "prompt": st.lists(tokens, min_size=1, max_size=6),
    "output": st.lists(tokens, max_size=6),
    "bias": st.dictionaries(tokens, st.floats(-100, 100, allow_nan=False), max_size=3),
    "min_tokens": st.integers(0, 4),
    "stop_ids": st.lists(tokens, max_size=2),
    "ignore_eos": st.booleans(),
    "presence": st.sampled_from([0.0, -1.5, 0.7, 2.0]),
    "frequency": st.sampled_from([0.0, -0.4, 1.1]),
    "repetition": st.sampled_from([1.0, 0.6, 1.3, 2.0]),
    "logprobs": st.sampled_from([None, 0, 3]),
})  # fmt: skip


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(row, min_size=1, max_size=5))
def test_greedy_picks_and_logprobs_match_the_reference(rows):
    logits = torch.tensor([r["logits"] for r in rows], dtype=torch.float32)
    params = [SamplingParams(max_tokens=8, logit_bias=r["bias"], min_tokens=r["min_tokens"], stop_token_ids=r["stop_ids"],
                             ignore_eos=r["ignore_eos"], presence_penalty=r["presence"], frequency_penalty=r["frequency"],
                             repetition_penalty=r["repetition"], logprobs=r["logprobs"]) for r in rows]  # fmt: skip
    histories = [(r["prompt"], r["output"]) for r in rows]
    sampler = Sampler(eos_token_ids=(EOS,))
    picked = sampler.sample(logits, [f"r{i}" for i in range(len(rows))], params, histories)
    for i, (r, p) in enumerate(zip(rows, params)):
        z = reference_logits(logits[i].tolist(), p, r["prompt"], r["output"])
        best = max(z)
        # float32 vs float64: any token within rounding of the reference's best is a correct pick.
        assert z[picked[i]] >= best - 1e-4 * max(1.0, abs(best)), (i, picked[i], z)
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, (entry, p) in enumerate(zip(Sampler.logprobs(logits, picked, params), params)):
        if p.logprobs is None:
            assert entry is None
            continue
        assert entry.token_id == picked[i] and abs(entry.logprob - raw[i, picked[i]].item()) < 1e-4
        assert len(entry.top) == p.logprobs


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(st.integers(-6, 6), min_size=VOCAB, max_size=VOCAB),  # coarse logits: ties at the k-th value and inside top_p's cut
    st.sampled_from([0.5, 1.0, 1.7]),
    st.integers(0, VOCAB),
    st.floats(0.05, 1.0),
)
def test_sampled_support_matches_transformers_warpers(logits, temperature, top_k, top_p):
    """temperature, top_k then top_p keep the same tokens as transformers' TemperatureLogitsWarper,
    TopKLogitsWarper and TopPLogitsWarper in that order (vLLM's apply_top_k_top_p draws the same
    lines). Compared as the multiset of kept logits, since which of several tied tokens top_p keeps
    is the sort's choice; rows whose top_p sits within rounding of a cumulative sum are skipped."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    z = torch.tensor(logits, dtype=torch.float32) * 0.7
    ref = TemperatureLogitsWarper(temperature)(None, z[None].clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    survivors = torch.softmax(ref[0].double(), 0).sort(descending=True).values
    if ((torch.cumsum(survivors, 0) - top_p).abs() < 1e-5).any():
        return
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    got = filtered_logits(z, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    kept, want = torch.isfinite(got), torch.isfinite(ref[0])
    assert sorted(z[kept].tolist()) == sorted(z[want].tolist()), (kept.tolist(), want.tolist())
