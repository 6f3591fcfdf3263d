"""What OpenAI clients send and expect, beyond the basic routes (test_routes.py): nullable
fields, chat content parts and roles, max_completion_tokens, GET /v1/models/{id}, error
fields (param, string codes), and errors raised after a stream has started."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

import anyio
import pytest

from runtime.server.app import create_app
from runtime.server.errors import APIError
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for, make_engine_config, sse_chunks

pytestmark = pytest.mark.anyio
DEMO_BASE = "runtime/demo_assets/base"  # has a chat template


@pytest.fixture(scope="module")
def demo_engine():
    from runtime.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(make_engine_config(DEMO_BASE, max_model_len=128, max_lora_rank=16))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def app(demo_engine):
    return create_app(demo_engine, ServerOptions())


def events(text: str) -> list[Any]:
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


async def test_null_means_the_default(app, demo_engine) -> None:
    name = demo_engine.model_name
    plain = {"model": name, "prompt": "hello world =>", "max_tokens": 6, "temperature": 0}
    nulls = {"top_p": None, "n": None, "presence_penalty": None, "frequency_penalty": None, "stream": None, "echo": None,
             "stop": None, "seed": None, "user": None, "logprobs": None}
    async with client_for(app) as c:
        want = (await c.post("/v1/completions", json=plain)).json()["choices"][0]["text"]
        got = await c.post("/v1/completions", json={**plain, **nulls})
        chat = await c.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                          "temperature": None, "top_p": None, "n": None, "stream": None})
        # null temperature is the default (1.0, sampling), not greedy: seeded runs agree with an explicit 1.0
        seeded = {"model": name, "prompt": "hello world =>", "max_tokens": 8, "seed": 7}
        null_t = (await c.post("/v1/completions", json={**seeded, "temperature": None})).json()["choices"][0]["text"]
        one_t = (await c.post("/v1/completions", json={**seeded, "temperature": 1.0})).json()["choices"][0]["text"]
        # null is not a wildcard: a field that is not nullable still refuses it
        model_null = await c.post("/v1/completions", json={**plain, "model": None})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want
    assert chat.status_code == 200, chat.text
    assert null_t == one_t
    assert model_null.status_code == 400 and model_null.json()["error"]["param"] == "model"


async def test_chat_content_parts_developer_role_and_name(app, demo_engine) -> None:
    name = demo_engine.model_name

    async def prompt_ids(messages: list[dict]) -> list[int]:
        async with client_for(app) as c:
            r = await c.post("/v1/chat/completions", json={"model": name, "messages": messages, "max_tokens": 1, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["prompt_token_ids"]

    plain = await prompt_ids([{"role": "system", "content": "be\nbrief"}, {"role": "user", "content": "hello\nworld"}])
    parts = await prompt_ids([{"role": "developer", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
                              {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}], "name": "bob"}])
    assert parts == plain  # developer renders as system; parts are joined with "\n" (as vLLM); the demo template ignores name
    earlier = await prompt_ids([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}, {"role": "user", "content": "b"}])
    empty = await prompt_ids([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "b"}])
    assert earlier == empty
    async with client_for(app) as c:
        image = await c.post("/v1/chat/completions", json={"model": name, "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
        no_content = await c.post("/v1/chat/completions", json={"model": name, "max_tokens": 1, "messages": [{"role": "user", "content": None}]})
    assert image.status_code == 400 and "image_url" in image.json()["error"]["message"]
    assert no_content.status_code == 400 and "needs content" in no_content.json()["error"]["message"]


async def test_openai_fields_left_unset_with_null_are_accepted(app, demo_engine) -> None:
    """An OpenAI client's reply message sent back as is (``message.model_dump()``: ``refusal``,
    ``tool_calls``, ... all null), null tool fields, and ``response_format`` text (OpenAI's default)
    are what lorafleet does anyway: accepted, the same prompt. They were 400s ("Extra inputs")."""
    name = demo_engine.model_name
    reply = {"content": "AB", "refusal": None, "role": "assistant", "annotations": None, "audio": None, "function_call": None, "tool_calls": None}
    plain = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "AB"}, {"role": "user", "content": "cd"}]
    unset = {"tools": None, "tool_choice": None, "parallel_tool_calls": None, "functions": None, "response_format": {"type": "text"}}
    async with client_for(app) as c:
        want = await c.post("/v1/chat/completions", json={"model": name, "messages": plain, "max_tokens": 1, "return_token_ids": True})
        got = await c.post("/v1/chat/completions", json={"model": name, "messages": [plain[0], reply, plain[2]], "max_tokens": 1,
                                                         "return_token_ids": True, **unset})  # fmt: skip
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["prompt_token_ids"] == want.json()["choices"][0]["prompt_token_ids"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_skip_special_tokens_true_is_what_lorafleet_does(app, demo_engine, path) -> None:
    """vLLM clients send ``skip_special_tokens: true`` (vLLM's default): the same reply as without it
    (null too); it was a 400 "unknown field". ``false`` is refused (test_routes)."""
    name = demo_engine.model_name
    body = {"model": name, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    body.update({"prompt": "ab"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "ab"}]})
    async with client_for(app) as c:
        plain = await c.post(path, json=body)
        replies = [await c.post(path, json={**body, "skip_special_tokens": value}) for value in (True, None)]
    assert plain.status_code == 200, plain.text
    for r in replies:
        assert r.status_code == 200, r.text
        assert r.json()["choices"] == plain.json()["choices"]


async def test_max_completion_tokens(app, demo_engine) -> None:
    body = {"model": demo_engine.model_name, "messages": [{"role": "user", "content": "hello world"}], "temperature": 0, "ignore_eos": True}
    async with client_for(app) as c:
        new = await c.post("/v1/chat/completions", json={**body, "max_completion_tokens": 3})
        both = await c.post("/v1/chat/completions", json={**body, "max_completion_tokens": 3, "max_tokens": 3})
        clash = await c.post("/v1/chat/completions", json={**body, "max_completion_tokens": 3, "max_tokens": 4})
    assert new.status_code == 200 and new.json()["usage"]["completion_tokens"] == 3
    assert both.status_code == 200 and both.json()["usage"]["completion_tokens"] == 3
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "max_completion_tokens"


async def test_retrieve_model_card(app, demo_engine) -> None:
    async with client_for(app) as c:
        listed = (await c.get("/v1/models")).json()["data"]
        one = await c.get(f"/v1/models/{demo_engine.model_name}")
        missing = await c.get("/v1/models/no-such-adapter")
    assert one.status_code == 200 and one.json() == listed[0]
    assert listed[0]["max_model_len"] == 128
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_an_unknown_route_or_a_wrong_method_says_what_was_asked(app) -> None:
    """Starlette's router answered "Not Found" and "Method Not Allowed" (its status phrases, in the
    OpenAI shape): the message now names the request and what the server has instead."""
    async with client_for(app) as c:
        no_route = await c.post("/v1/nothing-here", json={})
        wrong_method = await c.get("/v1/chat/completions")
    assert no_route.status_code == 404 and no_route.json()["error"] == {
        "message": "no route POST /v1/nothing-here; GET /openapi.json lists the routes", "type": "not_found_error", "param": None,
        "code": "not_found"}
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST" and wrong_method.json()["error"] == {
        "message": "GET /v1/chat/completions: method not allowed; this route takes POST", "type": "invalid_request_error", "param": None,
        "code": "method_not_allowed"}


async def test_error_fields(app, demo_engine) -> None:
    name = demo_engine.model_name
    async with client_for(app) as c:
        bad_json = await c.post("/v1/completions", content=b'{"model": "x", ', headers={"content-type": "application/json"})
        no_route = await c.get("/v1/nothing-here")
        wrong_method = await c.get("/v1/completions")
        too_long = await c.post("/v1/completions", json={"model": name, "prompt": [5] * 120, "max_tokens": 20})
        chat_long = await c.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "x" * 400}]})
        second = await c.post("/v1/completions", json={"model": name, "prompt": [[5, 6], [5] * 200], "max_tokens": 2})
        vocab = await c.post("/v1/completions", json={"model": name, "prompt": [[5, 6], [10**6]], "max_tokens": 2})
    err = bad_json.json()["error"]
    assert bad_json.status_code == 400 and err["param"] is None and "not valid JSON" in err["message"] and err["code"] == "invalid_json"
    assert no_route.json()["error"]["code"] == "not_found" and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"  # RFC 9110: a 405 names the allowed methods
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens", too_long.text
    assert chat_long.status_code == 400 and chat_long.json()["error"]["param"] == "messages", chat_long.text
    assert second.status_code == 400 and second.json()["error"]["param"] == "prompt.1", second.text
    assert second.json()["error"]["message"].startswith("prompt 1 (of 2): ")
    assert vocab.status_code == 400 and vocab.json()["error"]["param"] == "prompt.1", vocab.text


async def test_a_template_refusal_is_an_error_on_messages(app, demo_engine) -> None:
    """The demo template refuses a conversation that ends on the assistant (its raise_exception):
    chat and /tokenize answer 400 on ``messages``, the text led by the field's name."""
    messages = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "AB"}]
    async with client_for(app) as c:
        chat = await c.post("/v1/chat/completions", json={"model": demo_engine.model_name, "messages": messages})
        tokenize = await c.post("/tokenize", json={"model": demo_engine.model_name, "messages": messages})
    for r in (chat, tokenize):
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages" and err["code"] == "invalid_parameter", r.text
        assert err["message"].startswith("messages: chat_template: ") and "must be a user message" in err["message"], err


class _FailsMidStream:
    """The real engine, except that every stream raises ``error`` after its first two outputs
    (what a Ray replica dying mid-request does: ``ReplicaUnavailable``, a 503 APIError)."""

    def __init__(self, engine: Any, error: Exception) -> None:
        self._engine, self._error = engine, error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        inner = self._engine.generate(*args, **kwargs)
        error = self._error

        async def stream() -> AsyncIterator[Any]:
            try:
                sent = 0
                async for out in inner:
                    yield out
                    sent += 1
                    if sent == 2:
                        raise error
            finally:
                await inner.aclose()

        return stream()


@pytest.mark.parametrize("error, status, code", [(APIError(503, "the replica died; retry the request", code="replica_unavailable"), 503, "replica_unavailable"),
                                                 (RuntimeError("boom"), 500, "internal_error")])
async def test_error_after_the_stream_started_is_an_event_then_done(demo_engine, error, status, code) -> None:
    app = create_app(_FailsMidStream(demo_engine, error), ServerOptions())
    name = demo_engine.model_name
    common = {"model": name, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with client_for(app) as c:
        completion = await c.post("/v1/completions", json={**common, "prompt": "hello world =>"})
        chat = await c.post("/v1/chat/completions", json={**common, "messages": [{"role": "user", "content": "hello"}]})
    for response in (completion, chat):
        assert response.status_code == 200
        got = events(response.text)
        assert got[-1] == "[DONE]", got
        failure = got[-2]["error"]
        assert failure["code"] == code and failure["type"] == ("service_unavailable" if status == 503 else "internal_server_error")
        assert "usage" not in got[-2] and all("error" not in e for e in got[:-2])  # no usage chunk after a failure
    for _ in range(100):  # the failed streams' requests were aborted, not left running
        if not demo_engine.engine.has_unfinished():
            break
        await anyio.sleep(0.05)
    assert not demo_engine.engine.has_unfinished()


async def test_openapi_declares_the_400_the_server_sends(app) -> None:
    async with client_for(app) as c:
        spec = (await c.get("/openapi.json")).json()
        refused = await c.post("/v1/completions", json={"model": 1})
    assert "422" not in str(list(spec["paths"]["/v1/completions"]["post"]["responses"]))
    declared = spec["paths"]["/v1/completions"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
    assert declared == "#/components/schemas/ErrorResponse" and "HTTPValidationError" not in spec["components"]["schemas"]
    assert refused.status_code == 400 and set(refused.json()["error"]) == set(spec["components"]["schemas"]["ErrorResponse"]["properties"]["error"]["required"])
    for request in ("CompletionRequest", "ChatCompletionRequest"):  # the nullable fields say so
        props = spec["components"]["schemas"][request]["properties"]
        for field in ("temperature", "top_p", "n", "stream", "presence_penalty"):
            assert {"type": "null"} in props[field]["anyOf"], (request, field, props[field])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_with_include_usage_every_chunk_has_usage_null_but_the_last(app, demo_engine, path) -> None:
    """OpenAI: with stream_options.include_usage "all other chunks will also include a usage field,
    but with a null value"; the last has the whole request's. The field used to be left out of the
    other chunks. Without include_usage no chunk has it."""
    body = {"model": demo_engine.model_name, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2}
    body.update({"prompt": "ab"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "ab"}]})
    async with client_for(app) as c:
        with_usage = await sse_chunks(c, path, {**body, "stream_options": {"include_usage": True}})
        without = await sse_chunks(c, path, body)
    *others, last = with_usage
    assert len(others) >= 2 and all("usage" in ch and ch["usage"] is None for ch in others), others
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert without and not any("usage" in ch for ch in without)
