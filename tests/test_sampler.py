"""Sampler: greedy, seeded sampling, top-k/top-p support, stop rules; detokenizer stop strings."""
from __future__ import annotations

import pytest
import torch

from runtime.detokenizer import IncrementalDetokenizer
from runtime.request import SamplingParams
from runtime.sampler import Sampler, filtered_logits, token_stop_reason


def test_greedy_is_argmax_and_seeded_sampling_is_reproducible():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    p_greedy = SamplingParams()
    p_seed = SamplingParams(temperature=0.8, seed=7)
    s1, s2 = Sampler(), Sampler(seed=123)
    for s in (s1, s2):
        s.add("g", p_greedy)
        s.add("x", p_seed)
    draws1 = [s1.sample(logits[:2], ["g", "x"], [p_greedy, p_seed]) for _ in range(5)]
    draws2 = [s2.sample(logits[1:2], ["x"], [p_seed])[0] for _ in range(5)]
    assert all(d[0] == int(logits[0].argmax()) for d in draws1)
    assert [d[1] for d in draws1] == draws2, "a seeded request is independent of its batch"


def test_top_k_and_top_p_restrict_support():
    z = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    kept = torch.isfinite(filtered_logits(z, SamplingParams(temperature=1.0, top_k=2)))
    assert kept.tolist() == [True, True, False, False, False]
    probs = torch.softmax(z, 0)
    p = float(probs[0] + probs[1]) - 1e-4  # mass of the top two just exceeds p: keep exactly two
    kept = torch.isfinite(filtered_logits(z, SamplingParams(temperature=1.0, top_p=p)))
    assert kept.tolist() == [True, True, False, False, False]
    sampler = Sampler()
    params = SamplingParams(temperature=2.0, top_k=2, seed=1)
    sampler.add("r", params)
    draws = {sampler.sample(z[None], ["r"], [params])[0] for _ in range(200)}
    assert draws == {0, 1}


def test_stop_rules():
    p = SamplingParams(max_tokens=3, stop_token_ids=(9,))
    assert token_stop_reason(9, 1, p, [2]) == "stop"
    assert token_stop_reason(2, 1, p, [2]) == "stop"
    assert token_stop_reason(2, 1, SamplingParams(ignore_eos=True), [2]) is None
    assert token_stop_reason(5, 3, p, [2]) == "length"


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -1), ("max_tokens", 0), ("seed", -3), ("stop", [""])])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_detokenizer_cuts_at_stop_string_split_across_tokens_and_holds_back():
    vocab = ["he", "llo", " wo", "rld", "!"]
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    d = IncrementalDetokenizer(decode, stop=("o wor",))
    emitted = ""
    ids = []
    for tok in range(5):
        ids.append(tok)
        d.add_tokens(ids)
        emitted += d.take_delta(finished=d.stopped)
        if d.stopped:
            break
    assert d.stopped and d.text == "hell" and emitted == "hell"
