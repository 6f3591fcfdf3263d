"""``n`` choices per prompt over HTTP (in-process, a real engine on the tiny llama): OpenAI's
choice order (prompt i, sample j -> index i * n + j), seeded samples reproducible one by one
(choice j samples with seed + j), usage counting each prompt once, streaming per choice."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for, post_ok as post, sse_chunks as stream

pytestmark = pytest.mark.anyio

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def app(engine, adapter_root: Path):
    return create_app(engine, ServerOptions(adapter_roots=(adapter_root,)))


def completion(model: str, prompt, **fields) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True, **fields}


async def test_completion_choices_order_seeds_and_usage(app, engine) -> None:
    model = engine.adapters()[0].name
    prompts = ["first prompt", "the second one"]
    async with client_for(app) as c:
        reply = await post(c, "/v1/completions", completion(model, prompts, n=3, temperature=1.0, seed=7))
        choices = reply["choices"]
        assert [ch["index"] for ch in choices] == list(range(6))
        for i, prompt in enumerate(prompts):
            mine = choices[3 * i : 3 * i + 3]
            assert len({tuple(ch["token_ids"]) for ch in mine}) >= 2  # the samples differ
            for j, ch in enumerate(mine):
                alone = (await post(c, "/v1/completions", completion(model, prompt, temperature=1.0, seed=7 + j)))["choices"][0]
                assert ch["token_ids"] == alone["token_ids"] and ch["text"] == alone["text"], (i, j)
    prompt_tokens = sum(len(choices[3 * i]["prompt_token_ids"]) for i in range(2))
    assert reply["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 6 * MAX_TOKENS, "total_tokens": prompt_tokens + 6 * MAX_TOKENS}


async def test_seeded_choices_wrap_as_int64(app, engine) -> None:
    """Choice j samples with seed + j, added as 64-bit integers: from -2 the choices are seeds -2, -1
    and 0, and from 2**63 - 1 the next is -2**63 (it was (seed + j) mod 2**63, and negative seeds were refused)."""
    model = engine.model_name
    async with client_for(app) as c:
        for seed, seeds in ((-2, (-2, -1, 0)), (2**63 - 1, (2**63 - 1, -(2**63)))):
            choices = (await post(c, "/v1/completions", completion(model, "wrap", n=len(seeds), temperature=1.0, seed=seed)))["choices"]
            for j, ch in enumerate(choices):
                alone = (await post(c, "/v1/completions", completion(model, "wrap", temperature=1.0, seed=seeds[j])))["choices"][0]
                assert ch["token_ids"] == alone["token_ids"], (seed, j)
            assert len({tuple(ch["token_ids"]) for ch in choices}) == len(seeds)


async def test_greedy_choices_are_alike(app, engine) -> None:
    async with client_for(app) as c:
        choices = (await post(c, "/v1/completions", completion(engine.model_name, "same", n=2, temperature=0)))["choices"]
    assert choices[0]["token_ids"] == choices[1]["token_ids"]


async def test_streamed_chat_choices_match_the_whole_reply(app, engine) -> None:
    model = engine.adapters()[1].name
    body = {"model": model, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "n": 3, "temperature": 1.0, "seed": 11, "stream_options": {"include_usage": True}}
    async with client_for(app) as c:
        whole = await post(c, "/v1/chat/completions", {k: v for k, v in body.items() if k != "stream_options"})
        chunks = await stream(c, "/v1/chat/completions", body)
    texts = {k: "" for k in range(3)}
    roles = set()
    for ch in chunks:
        for choice in ch["choices"]:
            roles.update([choice["index"]] if choice["delta"].get("role") == "assistant" else [])
            texts[choice["index"]] += choice["delta"].get("content", "")
    assert roles == {0, 1, 2}
    assert [texts[k] for k in range(3)] == [ch["message"]["content"] for ch in whole["choices"]]
    assert len({ch["message"]["content"] for ch in whole["choices"]}) >= 2
    assert chunks[-1]["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] == 3 * MAX_TOKENS


async def test_too_many_choices_and_bad_prompts_are_named(app, engine) -> None:
    async with client_for(app) as c:
        r = await c.post("/v1/completions", json=completion(engine.model_name, ["a"] * 5, n=64))
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        r = await c.post("/v1/completions", json=completion(engine.model_name, ["short", "x" * 400], n=2))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt.1" and err["message"].startswith("prompt 1 (of 2)"), err
