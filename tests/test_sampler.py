"""Sampler: greedy, seeded sampling, top-k/top-p support, stop rules; detokenizer stop strings."""
from __future__ import annotations

import pytest
import torch

from runtime.detokenizer import IncrementalDetokenizer
from runtime.request import SamplingParams
from runtime.sampler import NON_FINITE_LOGITS, Sampler, filtered_logits, token_stop_reason


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


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("max_tokens", -1), ("seed", -3), ("stop", [""]),
                                          ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")), ("min_p", True)])
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


@pytest.mark.parametrize("stops, kept", [(("o wor",), "hello wor"), (("wo", "wor"), "hello wor"), (("llo", "o"), "hello")])
def test_include_stop_keeps_the_earliest_then_longest_stop_string(stops, kept):
    vocab = ["hello", " world", "!"]
    d = IncrementalDetokenizer(lambda ids: "".join(vocab[i] for i in ids), stop=stops, include_stop=True)
    ids, emitted = [], ""
    for tok in range(len(vocab)):
        ids.append(tok)
        d.add_tokens(ids)
        emitted += d.take_delta(finished=d.stopped)
        if d.stopped:
            break
    assert d.stopped and d.text == kept and emitted == kept


@pytest.mark.parametrize("include_stop", [False, True])
def test_streamed_deltas_add_up_to_the_text_and_hold_back_only_what_a_stop_could_take_back(include_stop: bool) -> None:
    """Random pieces and stop strings over a small alphabet: the deltas add up to the final text, which
    ends at (or right after, with include_stop) the earliest stop string; text handed out is never
    taken back; and with include_stop nothing is held back, so every delta is all the text so far."""
    import random

    rng = random.Random(11 + include_stop)
    for _ in range(300):
        vocab = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3))) for _ in range(6)]
        stops = tuple({"".join(rng.choice("abc") for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(1, 3))})
        d = IncrementalDetokenizer(lambda ids: "".join(vocab[i] for i in ids), stop=stops, include_stop=include_stop)
        ids, emitted = [], ""
        for _ in range(12):
            ids.append(rng.randrange(len(vocab)))
            d.add_tokens(ids)
            emitted += d.take_delta(finished=d.stopped)
            assert d.text.startswith(emitted)
            if include_stop:
                assert emitted == d.text
            if d.stopped:
                break
        emitted += d.take_delta(finished=True)
        full = "".join(vocab[i] for i in ids)
        hits = [(full.find(s), -len(s)) for s in stops if s in full]
        at, neg_len = min(hits) if hits else (len(full), 0)
        assert emitted == d.text == (full[: at - neg_len] if include_stop and hits else full[:at])


def _float64_softmax(z: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(z.double() / temperature, 0)


def _draw_counts(z: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """How often each token of the row ``z`` is drawn in ``n`` draws of one seeded request."""
    sampler = Sampler()
    sampler.add("r", params)
    counts = torch.zeros(z.shape[0], dtype=torch.float64)
    for _ in range(n):
        counts[sampler.sample(z[None], ["r"], [params])[0]] += 1
    return counts


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampled_frequencies_follow_softmax_over_temperature(temperature):
    """20000 seeded draws against float64 softmax(z / T): total variation within sampling noise
    (about 0.01 here), while using T = 1 or T^2 instead would be off by more than 0.09."""
    z = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    n = 20000
    counts = _draw_counts(z, SamplingParams(temperature=temperature, seed=5), n)
    want = _float64_softmax(z, temperature)
    tv = 0.5 * (counts / n - want).abs().sum()
    assert tv < 0.03, (counts / n, want)
    for wrong in (1.0, temperature**2):  # the distance a sampler ignoring or squaring T would show
        assert 0.5 * (_float64_softmax(z, wrong) - want).abs().sum() > 0.09


def test_filtered_logits_are_shifted_logits_over_temperature():
    z = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 4
    for temperature in (0.3, 1.0, 1.7):
        got = filtered_logits(z, SamplingParams(temperature=temperature)).double()
        torch.testing.assert_close(got, (z.double() - z.double().max()) / temperature, rtol=1e-6, atol=1e-5)


def test_top_p_applies_after_temperature():
    """top_p keeps tokens by softmax(z / T): at T = 0.25 the top token alone holds 0.98 of the mass,
    at T = 1 the top two hold 0.90, so top_p = 0.85 keeps one token at T = 0.25 and two at T = 1."""
    z = torch.tensor([1.0, 0.0, -1.0, -3.0])
    for temperature in (0.25, 1.0):
        probs = _float64_softmax(z, temperature)
        mass_before = torch.cumsum(probs, 0) - probs
        want = (mass_before < 0.85).tolist()
        kept = torch.isfinite(filtered_logits(z, SamplingParams(temperature=temperature, top_p=0.85))).tolist()
        assert kept == want
    assert sum(torch.isfinite(filtered_logits(z, SamplingParams(temperature=0.25, top_p=0.85)))) == 1
    assert sum(torch.isfinite(filtered_logits(z, SamplingParams(temperature=1.0, top_p=0.85)))) == 2


def test_min_p_keeps_the_tokens_within_min_p_of_the_top_one_after_temperature_then_top_p_renormalizes() -> None:
    """Random logits: min_p keeps exactly the tokens whose float64 softmax(z / T) probability is at
    least min_p times the largest (the top one always); it runs before top_p, so top_p's mass is
    taken over the tokens min_p kept (vLLM's order); and seeded draws follow the filtered softmax."""
    gen = torch.Generator().manual_seed(21)
    ran = cut = 0
    for trial in range(40):
        z = torch.randn(50, generator=gen) * 3
        temperature = float(torch.empty(()).uniform_(0.3, 2.0, generator=gen))
        min_p = float(torch.empty(()).uniform_(0.01, 0.9, generator=gen))
        probs = _float64_softmax(z, temperature)
        ratio = probs / probs.max()
        if ((ratio - min_p).abs() < 1e-5).any():
            continue  # a token on the line: float32 may fall either side of it
        kept = torch.isfinite(filtered_logits(z, SamplingParams(temperature=temperature, min_p=min_p)))
        assert kept.tolist() == (ratio >= min_p).tolist(), trial
        top_p = 0.8
        renorm = torch.where(ratio >= min_p, probs, torch.zeros_like(probs))
        renorm = renorm / renorm.sum()
        order = torch.argsort(renorm, descending=True)
        mass_before = torch.cumsum(renorm[order], 0) - renorm[order]
        want = torch.zeros(50, dtype=torch.bool)
        want[order[mass_before < top_p]] = True
        want &= ratio >= min_p
        if ((mass_before - top_p).abs() < 1e-5).any():
            continue
        got = torch.isfinite(filtered_logits(z, SamplingParams(temperature=temperature, min_p=min_p, top_p=top_p)))
        assert got.tolist() == want.tolist(), trial
        ran += 1
        cut += bool((want != (ratio >= min_p)).any())
    assert ran >= 35 and cut >= 5  # most trials ran, and in several top_p cut into what min_p kept
    assert torch.isfinite(filtered_logits(z, SamplingParams(temperature=1.0, min_p=1.0))).sum() == 1  # only the top token
    z = torch.tensor([2.0, 1.5, 0.0, -1.0])
    n = 4000
    counts = _draw_counts(z, SamplingParams(temperature=1.0, min_p=0.5, seed=3), n)  # keeps tokens 0 and 1 (ratio e^-0.5 = 0.61)
    want = torch.softmax(z[:2].double(), 0)
    assert counts[2:].sum() == 0 and (counts[:2] / n - want).abs().max() < 0.03


@pytest.mark.parametrize("temperature", [1e-46, 1e-40, 1e-38, 5e-6])
def test_tiny_temperature_is_greedy(temperature):
    """Below 1e-5 a temperature is greedy: z / T in float32 would overflow (or divide by zero once
    T underflows) and leave NaN probabilities that ``torch.multinomial`` rejects."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1)) * 30
    params = SamplingParams(temperature=temperature, seed=2)
    assert params.greedy
    sampler = Sampler()
    sampler.add("r", params)
    assert sampler.sample(logits[:1], ["r"], [params]) == [int(logits[0].argmax())]


def test_small_temperature_above_the_greedy_line_samples_without_overflow():
    logits = torch.tensor([[3e34, 2e34, 0.0, -3e34]])  # z / 2e-5 overflows float32 to inf (NaN softmax); z - max does not
    params = SamplingParams(temperature=2e-5, seed=0)
    assert not params.greedy
    sampler = Sampler()
    sampler.add("r", params)
    assert {sampler.sample(logits, ["r"], [params])[0] for _ in range(20)} == {0}
    assert torch.isfinite(torch.softmax(filtered_logits(logits[0], params), 0)).all()


def test_a_temperature_of_exactly_1e_5_samples():
    """The greedy line is strict (vLLM's ``temperature < _SAMPLING_EPS``): 1e-5 itself samples, so
    on a row of equal logits it draws several tokens rather than the argmax's lowest id."""
    params = SamplingParams(temperature=1e-5, seed=3)
    assert not params.greedy
    sampler = Sampler()
    sampler.add("r", params)
    assert len({sampler.sample(torch.zeros(1, 8), ["r"], [params])[0] for _ in range(40)}) > 1


def test_rows_with_nan_or_inf_logits_get_no_token_and_the_others_do():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(4))
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0, seed=9)
    sampler = Sampler()
    ids = ["a", "b", "c", "d", "e"]
    params = [greedy, sampled, greedy, sampled, sampled]
    for rid, p in zip(ids, params):
        sampler.add(rid, p)
    out = sampler.sample(logits, ids, params)
    assert out[0] == int(logits[0].argmax()) and out[1:4] == [NON_FINITE_LOGITS] * 3 and isinstance(out[4], int)


def test_seeds_that_differ_only_above_32_bits_draw_different_tokens():
    """torch's CPU generator keeps the low 32 bits of a seed: 5, 5 + 2^32 and 2^62 + 5 drew the
    same tokens. Seeds below 2^32 keep their streams (generator_for seeds them as they are)."""
    from runtime.sampler import generator_for

    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))

    def draws(seed: int) -> list[int]:
        sampler = Sampler()
        params = SamplingParams(temperature=1.0, seed=seed)
        sampler.add("r", params)
        return [sampler.sample(logits, ["r"], [params])[0] for _ in range(12)]

    streams = [draws(s) for s in (5, 5 + 2**32, 5 + 7 * 2**32, 2**62 + 5, 2**64 - 1)]
    assert len({tuple(s) for s in streams}) == len(streams)
    assert draws(5) == streams[0]  # a seed gives the same tokens every time
    plain = torch.Generator().manual_seed(5)
    assert torch.equal(torch.rand(4, generator=generator_for(5)), torch.rand(4, generator=plain))


LN2 = float(torch.log(torch.tensor(2.0)))


def _exact_quarters_row() -> torch.Tensor:
    """Logits whose float32 softmax is exactly 0.125, 0.5, 0.125, 0.25 (token 1 most likely, then
    3, then the tie 0 and 2): binary fractions, so every cumulative sum is exact and ``top_p``
    can sit exactly on one."""
    z = torch.tensor([0.0, 2.0, 0.0, 1.0]) * LN2
    assert torch.softmax(z, 0).tolist() == [0.125, 0.5, 0.125, 0.25]  # exact, else the boundaries below mean nothing
    return z


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.25, [1]), (0.5, [1]), (0.5000001, [1, 3]), (0.75, [1, 3]), (0.7500001, [1, 3, "one of 0, 2"]), (0.875, [1, 3, "one of 0, 2"])],
)
def test_top_p_keeps_the_token_that_reaches_top_p_and_no_more(top_p, kept):
    """A token is kept while the mass of the more likely tokens is < top_p: the token whose mass
    reaches top_p is kept, the next one dropped (vLLM's ``probs_sum <= 1 - p`` and transformers'
    ``TopPLogitsWarper``, both over ascending sums, draw the same line). At top_p = 0.75 = 0.5 + 0.25
    exactly, two tokens; just above it, or at 0.875, one of the tied 0.125s joins (which one is the
    sort's choice, here and there)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    z = _exact_quarters_row()
    got = torch.isfinite(filtered_logits(z, SamplingParams(temperature=1.0, top_p=top_p)))
    reference = torch.isfinite(TopPLogitsWarper(top_p)(None, z[None].clone()))[0]
    for keep in (got, reference):
        ids = torch.nonzero(keep).flatten().tolist()
        assert len(ids) == len(kept) and {t for t in kept if isinstance(t, int)} <= set(ids), (top_p, ids)


@pytest.mark.parametrize("top_k, kept", [(1, [1]), (2, [1, 3]), (3, [1, 3, 0, 2]), (4, [1, 3, 0, 2])])
def test_top_k_keeps_every_token_tied_with_the_kth(top_k, kept):
    """top_k keeps the tokens whose logit is at least the k-th largest, so a tie at the k-th value
    keeps them all (k = 3 keeps four tokens here), as vLLM's ``logits < kth`` mask and
    transformers' ``TopKLogitsWarper`` do; the sampled support is the same."""
    from transformers.generation.logits_process import TopKLogitsWarper

    z = _exact_quarters_row()
    params = SamplingParams(temperature=1.0, top_k=top_k, seed=4)
    got = torch.isfinite(filtered_logits(z, params))
    assert sorted(torch.nonzero(got).flatten().tolist()) == sorted(kept)
    assert got.tolist() == torch.isfinite(TopKLogitsWarper(top_k)(None, z[None].clone()))[0].tolist()
    if top_k == 3:
        sampler = Sampler()
        sampler.add("r", params)
        assert {sampler.sample(z[None], ["r"], [params])[0] for _ in range(300)} == {0, 1, 2, 3}


def test_top_p_takes_its_mass_over_the_tokens_top_k_kept():
    """vLLM's order: top_k first, then top_p over the renormalized survivors. top_k = 2 keeps the
    0.5 and 0.25 tokens (2/3 and 1/3 after renormalizing), so top_p = 0.6 keeps only the first; top_p
    over the whole row would have kept both (the mass before the second is 0.5 < 0.6)."""
    z = _exact_quarters_row()
    kept = torch.isfinite(filtered_logits(z, SamplingParams(temperature=1.0, top_k=2, top_p=0.6)))
    assert torch.nonzero(kept).flatten().tolist() == [1]
    assert torch.nonzero(torch.isfinite(filtered_logits(z, SamplingParams(temperature=1.0, top_p=0.6)))).flatten().tolist() == [1, 3]
