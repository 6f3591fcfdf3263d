"""Logprobs objects with an entry per token of a long text are built off the event loop, as long
prompts are encoded: an echoed prompt's (the prompt re-encoded for its offsets; a scoring client,
echo, logprobs and max_tokens 0, as evaluation harnesses send) and a whole chat reply's stalled
every other stream for as long as that took."""
from __future__ import annotations

import threading
from typing import Any

import pytest

from runtime.server import generation
from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for, post_ok, sse_chunks

pytestmark = pytest.mark.anyio


def app_recording_threads(engine: Any, monkeypatch: pytest.MonkeyPatch, long_text_chars: int, tokenizer_method: str) -> tuple[Any, list[Any]]:
    """An app whose "long text" threshold is ``long_text_chars`` (the test model's context holds no text of
    the real size), and the list of threads that call its tokenizer's ``tokenizer_method``."""
    monkeypatch.setattr(generation, "LONG_TEXT_CHARS", long_text_chars)
    app = create_app(engine, ServerOptions())
    tokenizer = app.state.lorafleet.tokenizer
    real = getattr(tokenizer, tokenizer_method)
    threads: list[Any] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, tokenizer_method, recorded)
    return app, threads


@pytest.mark.parametrize("stream", [False, True])
async def test_a_long_echoed_prompt_s_logprobs_are_built_off_the_event_loop(engine, stream: bool, monkeypatch) -> None:
    app, threads = app_recording_threads(engine, monkeypatch, 8, "encode_with_spans")
    loop_thread = threading.current_thread()
    body = {"model": engine.model_name, "prompt": "the quick brown fox jumps", "max_tokens": 0, "echo": True, "logprobs": 1}
    async with client_for(app) as c:
        if stream:
            chunks = await sse_chunks(c, "/v1/completions", body)
            entries = chunks[0]["choices"][0]["logprobs"]["tokens"]
        else:
            entries = (await post_ok(c, "/v1/completions", body))["choices"][0]["logprobs"]["tokens"]
    assert entries and threads and loop_thread not in threads


async def test_a_long_chat_reply_s_logprobs_are_built_off_the_event_loop(engine, monkeypatch) -> None:
    app, threads = app_recording_threads(engine, monkeypatch, 1, "token_bytes")
    loop_thread = threading.current_thread()
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    async with client_for(app) as c:
        reply = await post_ok(c, "/v1/chat/completions", body)
    assert len(reply["choices"][0]["logprobs"]["content"]) == 12
    assert threads and loop_thread not in threads
