"""Sampling fields over HTTP (in-process, httpx over ASGI, a real engine): temperature, top_p,
top_k, min_p, seed, stop_token_ids and ignore_eos reach the engine and are honoured. Every request that samples
carries a seed, so each assertion is deterministic; "differs" compares 8 sampled tokens over a
300-token vocabulary."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for

pytestmark = pytest.mark.anyio

MAX_TOKENS = 8
PROMPT = "sample me"


@pytest.fixture(scope="module")
def app(engine, adapter_root: Path):
    return create_app(engine, ServerOptions(adapter_roots=(adapter_root,)))


async def complete(c: httpx.AsyncClient, model: str, **fields) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True, **fields}
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


async def chat(c: httpx.AsyncClient, model: str, **fields) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "return_token_ids": True, **fields}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def models(engine) -> list[str]:
    return [engine.model_name, engine.adapters()[0].name]


async def test_seed_reproduces_and_another_seed_differs(app, engine) -> None:
    async with client_for(app) as c:
        for model in models(engine):
            a = await complete(c, model, temperature=1.0, seed=123)
            b = await complete(c, model, temperature=1.0, seed=123)
            other = await complete(c, model, temperature=1.0, seed=124)
            greedy = await complete(c, model, temperature=0)
            assert (a["text"], a["token_ids"]) == (b["text"], b["token_ids"]), f"{model}: the same seed gave different replies"
            assert a["token_ids"] != other["token_ids"] and a["text"] != other["text"], f"{model}: seeds 123 and 124 gave the same reply"
            assert a["token_ids"] != greedy["token_ids"], f"{model}: temperature 1.0 decoded greedily"
            assert len(a["token_ids"]) == MAX_TOKENS and a["finish_reason"] == "length"


async def test_chat_seed_reproduces_and_another_seed_differs(app, engine) -> None:
    model = engine.adapters()[1].name
    async with client_for(app) as c:
        a = await chat(c, model, temperature=1.0, seed=5)
        b = await chat(c, model, temperature=1.0, seed=5)
        other = await chat(c, model, temperature=1.0, seed=6)
        greedy = await chat(c, model, temperature=0)
    assert a["token_ids"] == b["token_ids"] and a["message"] == b["message"]
    assert a["token_ids"] != other["token_ids"]
    assert a["token_ids"] != greedy["token_ids"]


async def test_negative_seeds_reproduce_and_differ(app, engine) -> None:
    """OpenAI and vLLM take any int64 seed; a negative one was a 400. It seeds as its two's
    complement (mod 2**64): reproducible, unlike another negative seed, and unlike its absolute value."""
    model = engine.model_name
    async with client_for(app) as c:
        a = await complete(c, model, temperature=1.0, seed=-1)
        b = await complete(c, model, temperature=1.0, seed=-1)
        other = await complete(c, model, temperature=1.0, seed=-2)
        positive = await complete(c, model, temperature=1.0, seed=1)
        lowest = await complete(c, model, temperature=1.0, seed=-(2**63))
        chat_a = await chat(c, model, temperature=1.0, seed=-7)
        chat_b = await chat(c, model, temperature=1.0, seed=-7)
        below = await c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "seed": -(2**63) - 1})
    assert (a["text"], a["token_ids"]) == (b["text"], b["token_ids"])
    assert a["token_ids"] != other["token_ids"] and a["token_ids"] != positive["token_ids"]
    assert len(lowest["token_ids"]) == MAX_TOKENS
    assert chat_a["token_ids"] == chat_b["token_ids"]
    assert below.status_code == 400 and below.json()["error"]["param"] == "seed"


async def test_ignore_eos_reaches_the_engine(app, engine) -> None:
    """A logit_bias that makes the end-of-sequence token the greedy pick: ignore_eos false stops at it,
    ignore_eos true runs to max_tokens. (Every other test sends ignore_eos true to a random model that
    hardly ever picks eos, so a server that dropped the field passed them all.)"""
    eos = engine.tokenizer.eos_token_ids[0]
    async with client_for(app) as c:
        for route in (complete, chat):
            kept = await route(c, engine.model_name, temperature=0, logit_bias={str(eos): 100}, ignore_eos=True)
            stopped = await route(c, engine.model_name, temperature=0, logit_bias={str(eos): 100}, ignore_eos=False)
            assert kept["finish_reason"] == "length" and kept["token_ids"] == [eos] * MAX_TOKENS, (route.__name__, kept)
            assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == [eos], (route.__name__, stopped)  # the eos counts as generated


async def assert_only_top_is_greedy(c: httpx.AsyncClient, model: str, field: str, only_top: object, off: object) -> None:
    """``field: only_top`` keeps only the most likely token, so sampling at temperature 1.5 decodes
    greedily whatever the seed; ``field: off`` lets the same seeds leave greedy decoding."""
    greedy = await complete(c, model, temperature=0)
    for seed in (1, 2, 3):
        kept = await complete(c, model, temperature=1.5, seed=seed, **{field: only_top})
        assert kept["token_ids"] == greedy["token_ids"] and kept["text"] == greedy["text"], f"{model}: {field}={only_top} is not greedy"
    loose = [await complete(c, model, temperature=1.5, seed=seed, **{field: off}) for seed in (1, 2, 3)]
    assert any(o["token_ids"] != greedy["token_ids"] for o in loose), f"{model}: {field}={off} at temperature 1.5 stayed greedy"


async def test_top_k_one_matches_greedy(app, engine) -> None:
    async with client_for(app) as c:
        for model in models(engine):
            await assert_only_top_is_greedy(c, model, "top_k", 1, -1)  # -1 also means "off" (top_k=0 in the engine)


async def test_top_p_is_honoured(app, engine) -> None:
    async with client_for(app) as c:
        for model in models(engine):
            await assert_only_top_is_greedy(c, model, "top_p", 1e-6, 1.0)


async def test_min_p_is_honoured_on_both_routes_and_out_of_range_is_a_400(app, engine) -> None:
    async with client_for(app) as c:
        for model in models(engine):
            await assert_only_top_is_greedy(c, model, "min_p", 1.0, None)  # null: the default, off
        model = engine.adapters()[1].name
        assert (await chat(c, model, temperature=1.5, min_p=1.0, seed=4))["token_ids"] == (await chat(c, model, temperature=0))["token_ids"]
        for bad in (-0.5, 1.5, "0.1"):
            r = await c.post("/v1/completions", json={"model": engine.model_name, "prompt": PROMPT, "min_p": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text


async def test_stop_token_ids_end_the_reply(app, engine) -> None:
    async with client_for(app) as c:
        for model in models(engine):
            greedy = await complete(c, model, temperature=0)
            ids = greedy["token_ids"]
            assert len(ids) == MAX_TOKENS and greedy["finish_reason"] == "length"
            stop_id = ids[1]
            k = ids.index(stop_id)  # 0 or 1: where greedy decoding first produces it
            stopped = await complete(c, model, temperature=0, stop_token_ids=[stop_id])
            assert stopped["finish_reason"] == "stop", f"{model}: stop_token_ids {stop_id} did not stop the reply"
            assert stopped["token_ids"] == ids[: k + 1], "the reply ends at (and includes the id of) the stop token"
            assert greedy["text"].startswith(stopped["text"]) and len(stopped["text"]) < len(greedy["text"])
            # At temperature > 0 too: the stop id ends a sampled reply wherever it is drawn.
            sampled = await complete(c, model, temperature=1.0, seed=9)
            sid = sampled["token_ids"][2]
            cut = await complete(c, model, temperature=1.0, seed=9, stop_token_ids=[sid])
            assert cut["finish_reason"] == "stop"
            assert cut["token_ids"] == sampled["token_ids"][: sampled["token_ids"].index(sid) + 1]


async def test_include_stop_str_in_output_keeps_the_stop_string(app, engine) -> None:
    model = engine.adapters()[0].name
    async with client_for(app) as c:
        full = await complete(c, model, temperature=0)
        stop = full["text"][3:5]  # two characters from the middle of the greedy reply
        cut = await complete(c, model, temperature=0, stop=[stop])
        kept = await complete(c, model, temperature=0, stop=[stop], include_stop_str_in_output=True)
    assert stop and cut["finish_reason"] == kept["finish_reason"] == "stop"
    assert kept["text"] == cut["text"] + stop and full["text"].startswith(kept["text"])


async def test_include_stop_str_in_output_keeps_a_stop_token_ids_text(app, engine) -> None:
    """The text of the stop_token_ids token that ended the reply is kept with
    include_stop_str_in_output, as vLLM does; it was dropped either way."""
    model = engine.adapters()[0].name
    tok = engine.tokenizer
    async with client_for(app) as c:
        full = await complete(c, model, temperature=0)
        ids = full["token_ids"]
        k = next(i for i in range(1, len(ids)) if tok.token_text(ids[i]) and not tok.is_special(ids[i]) and ids[i] not in ids[:i])
        cut = await complete(c, model, temperature=0, stop_token_ids=[ids[k]])
        kept = await complete(c, model, temperature=0, stop_token_ids=[ids[k]], include_stop_str_in_output=True)
    assert cut["token_ids"] == kept["token_ids"] == ids[: k + 1]
    assert cut["text"] == tok.decode(ids[:k]) and kept["text"] == tok.decode(ids[: k + 1]) != cut["text"]
