"""logprobs and penalties over HTTP (in-process, a real engine on the tiny llama).

The values themselves are checked against transformers + PEFT in tests/test_logprobs_penalties.py;
here: the OpenAI shapes, one entry per generated token, streamed chunks adding up to the
whole reply, bytes that rebuild the text, and the penalties reaching the engine.
"""
from __future__ import annotations

import codecs

import math
from pathlib import Path

import pytest

from runtime.request import SamplingParams
from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for, post_ok as post, sse_chunks as stream

pytestmark = pytest.mark.anyio

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def app(engine, adapter_root: Path):
    return create_app(engine, ServerOptions(adapter_roots=(adapter_root,)))


def models(engine) -> list[str]:
    return [engine.model_name, engine.adapters()[0].name]


def assert_offsets_index(text: str, lp: dict) -> None:
    """Each token starts where its text sits in ``text`` (a token that is only part of a
    character, shown as U+FFFD, or a special token, which the text leaves out, at least does
    not move the offsets backwards)."""
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets), offsets
    for token, offset in zip(lp["tokens"], offsets):
        if "\ufffd" not in token and not (token.startswith("<") and token.endswith(">")):
            assert text[offset:].startswith(token), (token, offset, text)


def completion_body(model: str, **fields) -> dict:
    return {"model": model, "prompt": "tell me", "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True, **fields}


def chat_body(model: str, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "tell me"}], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "return_token_ids": True, **fields}


async def test_completion_logprobs_shape_and_consistency(app, engine) -> None:
    async with client_for(app) as c:
        for model in models(engine):
            choice = (await post(c, "/v1/completions", completion_body(model, logprobs=3, temperature=0)))["choices"][0]
            lp = choice["logprobs"]
            n = len(choice["token_ids"])
            assert n == MAX_TOKENS and all(len(lp[k]) == n for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
            assert "".join(lp["tokens"]) == choice["text"]
            assert_offsets_index(choice["text"], lp)
            for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
                assert value <= 0 and 1 <= len(top) <= 3
                best = max(top, key=top.get)  # greedy: the generated token is the most likely one
                assert best == token and top[best] == pytest.approx(value)
                assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6
            plain = (await post(c, "/v1/completions", completion_body(model, temperature=0)))["choices"][0]
            assert plain["logprobs"] is None and plain["token_ids"] == choice["token_ids"]  # asking for logprobs changes no token
            # Sampled, logprobs=0: each position still lists the sampled token itself (OpenAI: up to k + 1 entries).
            sampled = (await post(c, "/v1/completions", completion_body(model, logprobs=0, temperature=1.5, seed=3)))["choices"][0]["logprobs"]
            assert all(top == {token: value} for token, value, top in zip(sampled["tokens"], sampled["token_logprobs"], sampled["top_logprobs"]))


async def test_streamed_completion_logprobs_add_up_to_the_whole(app, engine) -> None:
    model = engine.adapters()[1].name
    async with client_for(app) as c:
        whole = (await post(c, "/v1/completions", completion_body(model, logprobs=2, temperature=0, stop=["zz"])))["choices"][0]
        chunks = await stream(c, "/v1/completions", completion_body(model, logprobs=2, temperature=0, stop=["zz"]))
    parts = [ch["choices"][0]["logprobs"] for ch in chunks if ch["choices"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p[key]] == pytest.approx(whole["logprobs"][key]) if key == "token_logprobs" else \
            [x for p in parts for x in p[key]] == whole["logprobs"][key]


def assert_entries_never_lead_the_text(texts: list[str], tokens: list[list[str]]) -> None:
    """Chunk by chunk, the entries' token texts so far are a prefix of the text sent so far: an
    entry comes with the chunk that carries its token's text or after it, never before (a stop
    string holds text back; here nothing in the text is special or a split character)."""
    sent = entries = ""
    for text, toks in zip(texts, tokens):
        sent, entries = sent + text, entries + "".join(toks)
        assert sent.startswith(entries), (sent, entries)


async def test_streamed_logprobs_wait_for_text_a_stop_string_holds_back(app, engine) -> None:
    """A three-character stop string that never matches holds the last two characters of the text
    back until the end; the entries of their tokens wait with them (they came two chunks early)."""
    model = engine.model_name
    async with client_for(app) as c:
        done = await stream(c, "/v1/completions", completion_body(model, logprobs=0, temperature=0, stop=["\x00\x01\x02"]))
        chat = await stream(c, "/v1/chat/completions", chat_body(model, logprobs=True, temperature=0, stop=["\x00\x01\x02"]))
    parts = [ch["choices"][0] for ch in done if ch["choices"]]
    # The text is exactly its tokens' texts (no special token, no split character), so the prefix check below applies.
    assert len(parts) >= 3 and "".join(t for p in parts for t in p["logprobs"]["tokens"]) == "".join(p["text"] for p in parts)
    assert_entries_never_lead_the_text([p["text"] for p in parts], [p["logprobs"]["tokens"] for p in parts])
    assert [o for p in parts for o in p["logprobs"]["text_offset"]] == sorted(o for p in parts for o in p["logprobs"]["text_offset"])
    sent = "".join(p["text"] for p in parts)
    for p in parts:  # each offset indexes the text as the client has it when the entry arrives
        for token, offset in zip(p["logprobs"]["tokens"], p["logprobs"]["text_offset"]):
            assert sent[offset:].startswith(token)
    # Chat, where this model's reply has split characters: counted in characters, the entries' bytes
    # decoded so far never pass the text sent so far.
    deltas = [ch["choices"][0] for ch in chat if ch["choices"] and ch["choices"][0]["logprobs"] is not None]
    utf8, sent_chars, entry_chars = codecs.getincrementaldecoder("utf-8")(errors="replace"), 0, 0
    for d in deltas[:-1]:  # the last chunk flushes whatever is left
        sent_chars += len(d["delta"].get("content", ""))
        entry_chars += len(utf8.decode(bytes(b for e in d["logprobs"]["content"] for b in e["bytes"] or ())))
        assert entry_chars <= sent_chars, (entry_chars, sent_chars, d)
    assert sum(len(d["logprobs"]["content"]) for d in deltas) == MAX_TOKENS  # every entry still comes, the last ones at the end


async def test_chat_logprobs_bytes_rebuild_the_reply(app, engine) -> None:
    async with client_for(app) as c:
        for model in models(engine):
            choice = (await post(c, "/v1/chat/completions", chat_body(model, logprobs=True, top_logprobs=2, temperature=0)))["choices"][0]
            content = choice["logprobs"]["content"]
            assert len(content) == len(choice["token_ids"]) == MAX_TOKENS and choice["logprobs"]["refusal"] is None
            assert bytes(b for entry in content for b in entry["bytes"]).decode("utf-8", errors="replace") == choice["message"]["content"]
            for entry in content:
                assert [set(t) for t in entry["top_logprobs"]] == [{"token", "logprob", "bytes"}] * 2
                assert entry["top_logprobs"][0]["token"] == entry["token"] and entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
            bare = (await post(c, "/v1/chat/completions", chat_body(model, logprobs=True, temperature=0)))["choices"][0]
            assert [e["top_logprobs"] for e in bare["logprobs"]["content"]] == [[]] * MAX_TOKENS  # top_logprobs defaults to 0


async def test_streamed_chat_logprobs_add_up_to_the_whole(app, engine) -> None:
    model = engine.adapters()[0].name
    body = chat_body(model, logprobs=True, top_logprobs=1, temperature=0)
    async with client_for(app) as c:
        whole = (await post(c, "/v1/chat/completions", body))["choices"][0]["logprobs"]["content"]
        chunks = await stream(c, "/v1/chat/completions", body)
    streamed = [e for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"] for e in ch["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole])


async def test_penalties_reach_the_engine(app, engine) -> None:
    model = engine.adapters()[0].name
    fields = dict(presence_penalty=-2.0, frequency_penalty=-1.0, repetition_penalty=0.5)  # pull towards repeats: they change the reply
    async with client_for(app) as c:
        penalized = (await post(c, "/v1/completions", completion_body(model, temperature=0, **fields)))["choices"][0]
        plain = (await post(c, "/v1/completions", completion_body(model, temperature=0)))["choices"][0]
    direct = None
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **fields)
    async for out in engine.generate("direct-penalties", penalized["prompt_token_ids"], params, model):
        direct = out
    assert penalized["token_ids"] == list(direct.token_ids)
    assert penalized["token_ids"] != plain["token_ids"]


@pytest.mark.parametrize("field, value", [("presence_penalty", -2.0), ("frequency_penalty", -2.0), ("repetition_penalty", 0.5)])
async def test_each_penalty_on_its_own_reaches_the_engine(app, engine, field, value) -> None:
    """One penalty at a time: with all three together (above) the others decided the reply, so a
    server that dropped frequency_penalty (accepted, then not passed on) still passed."""
    model = engine.adapters()[0].name
    async with client_for(app) as c:
        penalized = (await post(c, "/v1/completions", completion_body(model, temperature=0, **{field: value})))["choices"][0]
        plain = (await post(c, "/v1/completions", completion_body(model, temperature=0)))["choices"][0]
    direct = None
    async for out in engine.generate(f"direct-{field}", penalized["prompt_token_ids"], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **{field: value}), model):
        direct = out
    assert penalized["token_ids"] == list(direct.token_ids)
    assert penalized["token_ids"] != plain["token_ids"], f"{field}={value} does not change this reply: the check above cannot fail"


@pytest.mark.parametrize("route, fields, param", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
])  # fmt: skip
async def test_out_of_range_fields_are_400s_naming_them(app, engine, route, fields, param) -> None:
    body = (chat_body if "chat" in route else completion_body)(engine.model_name, **fields)
    async with client_for(app) as c:
        r = await c.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_echo_puts_the_prompt_and_its_logprobs_first(app, engine) -> None:
    model = engine.adapters()[0].name
    async with client_for(app) as c:
        # lm-eval-harness's loglikelihood request: echo, logprobs 1, one token.
        choice = (await post(c, "/v1/completions", completion_body(model, prompt="score this text", echo=True, logprobs=1,
                                                                   max_tokens=1, temperature=0)))["choices"][0]  # fmt: skip
        plain = (await post(c, "/v1/completions", completion_body(model, prompt="score this text", max_tokens=1, temperature=0)))["choices"][0]
        bare = (await post(c, "/v1/completions", completion_body(model, prompt=[5, 6, 7], echo=True, max_tokens=2, temperature=0)))["choices"][0]
    prompt_ids = choice["prompt_token_ids"]
    lp = choice["logprobs"]
    assert choice["text"] == "score this text" + plain["text"]
    assert len(lp["tokens"]) == len(prompt_ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert_offsets_index(choice["text"], lp)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][len(prompt_ids)] == len("score this text")  # the reply starts after the prompt
    direct = None
    async for out in engine.generate("direct-echo", prompt_ids, SamplingParams(max_tokens=1, prompt_logprobs=1, logprobs=1), model):
        direct = out
    assert lp["token_logprobs"][1:-1] == pytest.approx([e.logprob for e in direct.prompt_logprobs[1:]])
    assert lp["token_logprobs"][-1] == pytest.approx(direct.logprobs[0].logprob)
    # logprobs=1: the most likely token, and the token itself when that is another one (OpenAI: up to k + 1).
    assert all(1 <= len(top) <= 2 and top[token] == pytest.approx(value) for token, value, top in
               zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]))  # fmt: skip
    assert any(len(top) == 2 for top in lp["top_logprobs"][1:])  # some prompt token is not the model's first choice
    assert bare["text"].startswith(engine.tokenizer.decode([5, 6, 7])) and bare["logprobs"] is None


async def test_streamed_echo_adds_up_to_the_whole(app, engine) -> None:
    model = engine.adapters()[1].name
    body = completion_body(model, prompt=["first one", "second"], echo=True, logprobs=2, temperature=0, n=2)
    async with client_for(app) as c:
        whole = (await post(c, "/v1/completions", body))["choices"]
        chunks = await stream(c, "/v1/completions", body)
    for k, choice in enumerate(whole):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == k]
        assert mine[0]["text"] == ["first one", "second"][k // 2] and mine[0]["finish_reason"] is None
        assert "".join(m["text"] for m in mine) == choice["text"]
        for key in ("tokens", "text_offset"):
            assert [x for m in mine for x in m["logprobs"][key]] == choice["logprobs"][key], (k, key)
        streamed_top = [x for m in mine for x in m["logprobs"]["top_logprobs"]]  # other batches: float noise, same tokens
        assert [None if t is None else list(t) for t in streamed_top] == [None if t is None else list(t) for t in choice["logprobs"]["top_logprobs"]]
        streamed_lp = [x for m in mine for x in m["logprobs"]["token_logprobs"]]
        assert streamed_lp[0] is None and streamed_lp[1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:], abs=1e-5)


async def test_continuous_usage_covers_the_echo_chunk(app, engine) -> None:
    """With continuous_usage_stats every chunk has usage, the echoed prompt's chunk too (prompt only)."""
    model = engine.adapters()[0].name
    body = completion_body(model, prompt="echo me", echo=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    async with client_for(app) as c:
        chunks = await stream(c, "/v1/completions", body)
    with_choices = [ch for ch in chunks if ch["choices"]]
    assert all("usage" in ch for ch in with_choices), with_choices[0]
    first = with_choices[0]["usage"]
    assert first["completion_tokens"] == 0 and first["total_tokens"] == first["prompt_tokens"] > 0
    assert with_choices[-1]["usage"]["completion_tokens"] == MAX_TOKENS


async def test_max_tokens_zero_with_echo_scores_the_prompt_only(app, engine) -> None:
    model = engine.adapters()[0].name
    body = completion_body(model, prompt="score only this", echo=True, logprobs=2, max_tokens=0)
    async with client_for(app) as c:
        reply = await post(c, "/v1/completions", body)
        chunks = await stream(c, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        one = (await post(c, "/v1/completions", {**body, "max_tokens": 1}))["choices"][0]
        refused = await c.post("/v1/completions", json=completion_body(model, max_tokens=0))
        chat = await c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0})
    choice = reply["choices"][0]
    prompt_len = len(choice["prompt_token_ids"])
    assert choice["text"] == "score only this" and choice["token_ids"] == [] and choice["finish_reason"] == "length"
    assert reply["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 0, "total_tokens": prompt_len}
    assert len(choice["logprobs"]["tokens"]) == prompt_len and choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(one["logprobs"]["token_logprobs"][1:prompt_len])
    streamed = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert "".join(s["text"] for s in streamed) == "score only this" and streamed[-1]["finish_reason"] == "length"
    assert [t for s in streamed for t in s["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    for r in (refused, chat):
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def generated_tokens(metrics_text: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics_text.splitlines() if line.startswith("lorafleet_generation_tokens_total{"))


async def test_scoring_generates_nothing_and_fits_a_full_context(app, engine) -> None:
    """Score-only requests run no sampling step: /metrics counts no generated token (it counted
    the hidden one), and a prompt may fill max_model_len (one position short, it was refused)."""
    model = engine.adapters()[0].name
    full = list(range(5, 5 + engine.max_model_len))
    async with client_for(app) as c:
        before = generated_tokens((await c.get("/metrics")).text)
        reply = await post(c, "/v1/completions", completion_body(model, prompt=full, echo=True, logprobs=0, max_tokens=0))
        after = generated_tokens((await c.get("/metrics")).text)
        too_long = await c.post("/v1/completions", json=completion_body(model, prompt=full + [5], echo=True, max_tokens=0))
    assert reply["usage"]["prompt_tokens"] == engine.max_model_len and reply["choices"][0]["token_ids"] == []
    assert len(reply["choices"][0]["logprobs"]["tokens"]) == engine.max_model_len
    assert after == before
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt", too_long.text


async def test_logit_bias_and_min_tokens_reach_the_engine(app, engine) -> None:
    model = engine.adapters()[0].name
    async with client_for(app) as c:
        forced = (await post(c, "/v1/completions", completion_body(model, temperature=0, logit_bias={"77": 100})))["choices"][0]
        assert forced["token_ids"] == [77] * MAX_TOKENS
        chat = (await post(c, "/v1/chat/completions", chat_body(model, temperature=0, logit_bias={"77": 100})))["choices"][0]
        assert chat["token_ids"] == [77] * MAX_TOKENS
        # eos as the only token worth anything: min_tokens holds it back for 3 tokens, then it ends the reply.
        eos = engine.tokenizer.eos_token_ids[0]
        body = completion_body(model, temperature=0, logit_bias={str(eos): 100}, min_tokens=3, ignore_eos=False)
        held = (await post(c, "/v1/completions", body))["choices"][0]
        assert len(held["token_ids"]) == 4 and held["token_ids"][-1] == eos and held["finish_reason"] == "stop"
        for fields, param in [({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                              ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"min_tokens": MAX_TOKENS + 1}, "min_tokens"),
                              ({"min_tokens": -1}, "min_tokens")]:  # fmt: skip
            r = await c.post("/v1/completions", json=completion_body(model, **fields))
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)


async def test_text_offsets_count_characters_not_token_strings(app, engine) -> None:
    """"é" is two byte tokens (each shown as U+FFFD): both start at the character's offset, and
    the BOS token the text leaves out takes no room."""
    model = engine.adapters()[0].name
    async with client_for(app) as c:
        choice = (await post(c, "/v1/completions", completion_body(model, prompt="é!", echo=True, logprobs=0, max_tokens=0)))["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "é!" and lp["text_offset"] == [0] * (len(lp["tokens"]) - 1) + [1], lp


async def test_sampling_field_edge_cases_are_named_400s_and_the_engine_stays_up(app, engine) -> None:
    model = engine.adapters()[0].name
    cases = [({"logit_bias": {"²": 1}}, "logit_bias"), ({"logit_bias": {"07": 100, "7": -100}}, "logit_bias"),
             ({"logit_bias": {"7": "100"}}, "logit_bias.7"), ({"logit_bias": {"7": True}}, "logit_bias.7"),
             ({"min_tokens": 2, "stop_token_ids": [10**6]}, "stop_token_ids"),
             ({"echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
             ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"), ({"logit_bias": {"9" * 5000: 1}}, "logit_bias")]  # fmt: skip
    async with client_for(app) as c:
        for fields, param in cases:
            r = await c.post("/v1/completions", json=completion_body(model, **fields))
            assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (fields, r.text)
        assert (await c.get("/health")).status_code == 200
        # Score only: nothing was generated, so the reply ends for "length", even when the token run internally was eos.
        eos = engine.tokenizer.eos_token_ids[0]
        scored = await post(c, "/v1/completions", completion_body(model, echo=True, max_tokens=0, logit_bias={str(eos): 100}, ignore_eos=False))
        assert scored["choices"][0]["finish_reason"] == "length"
        # Repetition penalties past float32's range (schemathesis found 1e-300 failing the engine step).
        for r in (1e-300, 1e300):
            for temperature in (0.0, 1.0):
                reply = await post(c, "/v1/completions", completion_body(model, repetition_penalty=r, temperature=temperature))
                assert len(reply["choices"][0]["token_ids"]) == MAX_TOKENS, (r, temperature)
        assert (await c.get("/health")).status_code == 200
        # Parameters that leave no token to sample (the tiny vocabulary of 300 makes it reachable):
        # min_tokens bans ids 0-255, and the prompt ids 256-299, biased to -100, go to -inf under a
        # huge repetition penalty. The client's mistake: a 400, streamed or not, for that request alone.
        vocab = engine.engine.runner.model_config.vocab_size
        ban_all = dict(prompt=list(range(256, vocab)), min_tokens=1, stop_token_ids=list(range(256)),
                       logit_bias={str(t): -100 for t in range(256, vocab)}, repetition_penalty=1e38)  # fmt: skip
        r = await c.post("/v1/completions", json=completion_body(model, **ban_all))
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "invalid_parameter" and "no token" in err["message"], r.text
        events = await stream(c, "/v1/completions", completion_body(model, **ban_all))
        assert events[-1]["error"]["code"] == "invalid_parameter", events
        assert (await c.get("/health")).status_code == 200


async def test_min_tokens_holds_back_stop_strings_too(app, engine) -> None:
    model = engine.adapters()[0].name
    async with client_for(app) as c:
        full = (await post(c, "/v1/completions", completion_body(model, temperature=0)))["choices"][0]
        stop = full["text"][0]  # the reply's first character: a plain stop would end it at once
        early = (await post(c, "/v1/completions", completion_body(model, temperature=0, stop=[stop])))["choices"][0]
        held = (await post(c, "/v1/completions", completion_body(model, temperature=0, stop=[stop], min_tokens=MAX_TOKENS)))["choices"][0]
    assert early["text"] == "" and early["finish_reason"] == "stop"
    assert held["token_ids"] == full["token_ids"] and len(held["token_ids"]) == MAX_TOKENS


def test_streamed_entries_wait_for_the_character_their_bytes_complete() -> None:
    """StreamedEntries on a stand-in tokenizer: a character's first byte waits for the token that
    completes it; a special token goes with the next chunk at or past where it stands."""
    from runtime.request import TokenLogprobs
    from runtime.server.logprobs import StreamedEntries

    class Bytes:
        raw = {1: b"\xcf", 2: b"\x9a", 3: b"a", 4: None}  # 1 + 2: "Ϛ"; 4: special

        def is_special(self, token_id: int) -> bool:
            return token_id == 4

        def token_bytes(self, token_id: int):
            return self.raw[token_id]

        def token_text(self, token_id: int) -> str:
            return "<s>" if token_id == 4 else self.raw[token_id].decode("latin-1")

    entry = lambda t: TokenLogprobs(token_id=t, logprob=-1.0, top=())  # noqa: E731
    streamed = StreamedEntries(Bytes())
    streamed.add([entry(3), entry(1)])
    assert [e.token_id for e in streamed.release("a", False)] == [3]  # byte 0xcf is half a character: it waits
    streamed.add([entry(2), entry(4)])
    assert [e.token_id for e in streamed.release("", False)] == []  # no text sent: "Ϛ" is not out yet
    assert [e.token_id for e in streamed.release("Ϛ", False)] == [1, 2, 4]  # the character, then the special token at its end
    streamed.add([entry(3)])
    assert [e.token_id for e in streamed.release("", True)] == [3]  # the last chunk takes what is left


async def test_echoed_text_offsets_index_a_prompt_that_spells_a_special_token(app, engine) -> None:
    """A text prompt is echoed as sent; where it spells a special token (the eos's text here), the
    tokenizer reads that token, which decoding drops: the offsets are where each token was found in
    the prompt, so every one (the special token too) starts where its text sits in the reply."""
    model = engine.adapters()[0].name
    eos_text = engine.tokenizer.token_text(engine.tokenizer.eos_token_ids[0])
    prompt = f"{eos_text}ab =>"
    assert engine.tokenizer.eos_token_ids[0] in engine.tokenizer.encode(prompt)  # the text does spell it
    async with client_for(app) as c:
        whole = (await post(c, "/v1/completions", completion_body(model, prompt=prompt, echo=True, logprobs=0, max_tokens=3, temperature=0)))
        chunks = await stream(c, "/v1/completions", completion_body(model, prompt=prompt, echo=True, logprobs=0, max_tokens=3, temperature=0))
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    prompt_tokens = len(choice["prompt_token_ids"])
    bos = engine.tokenizer.bos_token_id
    for token_id, token, offset in zip(choice["prompt_token_ids"], lp["tokens"], lp["text_offset"]):
        if token_id != bos:  # the bos is not in the text; it starts at 0
            assert choice["text"][offset:].startswith(token), (token, offset, choice["text"])
    assert lp["text_offset"][prompt_tokens:][0] == len(prompt)  # the generated tokens start after the prompt as sent
    streamed = [o for ch in chunks if ch["choices"] for o in ch["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == lp["text_offset"]
