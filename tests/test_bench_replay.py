"""The replays' timing rules: an offline burst is admitted as one group (so it replays the same
way every time), and over HTTP a server without running usage counts is timed from its text
chunks, with a warning, rather than getting TTFT = latency and TPOT = 0."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import httpx
import pytest

from runtime.bench.replay import replay_engine, replay_http


@dataclass(frozen=True)
class Req:
    index: int
    arrival_s: float
    adapter: str | None
    prompt: str
    output_tokens: int


class _GroupRecordingEngine:
    """Stands in for AsyncLLMEngine: records which admission group each request came with."""

    def __init__(self) -> None:
        self.groups: dict[str, object] = {}

    def add_observer(self, callback) -> None:
        pass

    def snapshot(self) -> dict:
        return {}

    @staticmethod
    def admission_group(size: int) -> object:
        return ("group", size, object())

    async def generate(self, request_id, prompt, params, adapter, group=None):
        from runtime.request import RequestOutput

        self.groups[request_id] = group
        yield RequestOutput(request_id, None, (1,), "x", (1,), "x", True, "length", None, (5,))


def test_requests_sharing_an_arrival_time_are_admitted_as_one_group() -> None:
    engine = _GroupRecordingEngine()
    reqs = [Req(0, 0.0, "a", "p", 1), Req(1, 0.0, None, "p", 1), Req(2, 0.0, "b", "p", 1), Req(3, 0.01, "a", "p", 1)]
    result = asyncio.run(replay_engine(engine, reqs, "t"))
    assert not any(r.error for r in result.records)
    burst = {engine.groups[f"t-{i}"] for i in range(3)}
    assert len(burst) == 1 and next(iter(burst))[:2] == ("group", 3)
    assert engine.groups["t-3"] is None  # alone at its arrival time


def test_a_burst_sees_every_adapter_where_the_burst_found_it(tiny_llama_dir, tiny_adapters) -> None:
    """All on the host tier when the burst arrives, none on a device slot yet: every request says
    "host" (admitted one by one, requests admitted after the first step found some on the device)."""
    from runtime.async_engine import AsyncLLMEngine
    from runtime.config import EngineConfig

    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64, block_size=4, max_loras=1, max_cpu_loras=4))
    try:
        for name in ("a", "b", "c"):
            engine.register_adapter(name, str(tiny_adapters[name]))
        reqs = [Req(i, 0.0, "abc"[i % 3], "hello there", 3) for i in range(12)]
        result = asyncio.run(replay_engine(engine, reqs, "burst"))
    finally:
        engine.shutdown()
    assert not any(r.error for r in result.records)
    assert [r.adapter_location for r in result.records] == ["host"] * 12


def _sse_app(chunks_per_request: list[dict], delay_s: float = 0.01):
    """An ASGI app: /v1/completions streams ``chunks_per_request`` as SSE, ``delay_s`` apart; a
    non-streaming request (the warm-up) gets a plain reply."""

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        if not request.get("stream"):
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"choices": [{"text": "ok"}]}'})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for chunk in chunks_per_request:
            await asyncio.sleep(delay_s)
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def _replay(chunks: list[dict]) -> list:
    transport = httpx.ASGITransport(app=_sse_app(chunks))
    reqs = [Req(0, 0.0, None, "p", 4), Req(1, 0.0, None, "p", 4)]
    return asyncio.run(replay_http("http://stub", "base", reqs, "t", transport=transport)).records


def _text(t: str) -> dict:
    return {"choices": [{"index": 0, "text": t}]}


def test_http_timing_with_running_usage_counts_tokens() -> None:
    chunks = [{**_text("a"), "usage": {"prompt_tokens": 2, "completion_tokens": k}} for k in (1, 2, 3, 4)]
    for rec in _replay(chunks):
        assert rec.timing == "tokens" and rec.output_tokens == 4 and rec.prompt_tokens == 2
        assert 0 < rec.ttft < rec.latency and rec.tpot > 0


def test_http_timing_without_running_usage_falls_back_to_text_chunks(caplog) -> None:
    chunks = [_text("a"), _text("b"), _text("c"), _text("d"), {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}}]
    with caplog.at_level(logging.WARNING, logger="lorafleet.bench"):
        records = _replay(chunks)
    for rec in records:
        assert rec.timing == "text" and rec.output_tokens == 4 and rec.error is None
        assert 0 < rec.ttft < rec.latency and rec.tpot > 0  # not TTFT = latency and TPOT = 0
    assert "2 of 2 streams reported usage only at the end" in caplog.text


def test_http_stream_with_no_usage_counts_its_text_chunks() -> None:
    for rec in _replay([_text("a"), _text("b"), _text("c")]):
        assert rec.timing == "text" and rec.output_tokens == 3 and rec.ttft < rec.latency


def test_http_stream_whose_text_came_in_one_chunk_is_timed_at_that_chunk(caplog) -> None:
    """One text chunk and no usage was recorded as failed ("carried no tokens"); one text chunk then
    usage at the end was timed at the usage chunk, with a TPOT of 0 that nothing measured."""
    usage_at_end = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}}
    with caplog.at_level(logging.WARNING, logger="lorafleet.bench"):
        for chunks, n_out in (([_text("a")], 1), ([_text("abcd"), usage_at_end], 4)):
            for rec in _replay(chunks):
                assert rec.error is None and rec.timing == "text" and rec.output_tokens == n_out, rec
                assert rec.ttft is not None and rec.ttft == rec.latency and rec.tpot is None, rec  # first and last token: that chunk
    assert "2 of 2 streams reported usage only at the end" in caplog.text


def test_http_one_token_answer_under_running_usage_is_timed_by_its_count(caplog) -> None:
    """A chunk with the text and a count of 1 is running usage (lorafleet, vLLM), not usage at the end:
    no "text" timing and no warning that the server lacks continuous_usage_stats."""
    with caplog.at_level(logging.WARNING, logger="lorafleet.bench"):
        records = _replay([{**_text("a"), "usage": {"prompt_tokens": 2, "completion_tokens": 1}},
                           {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}])  # fmt: skip
    for rec in records:
        assert rec.error is None and rec.timing == "tokens" and rec.output_tokens == 1 and rec.tpot is None, rec
    assert "usage only at the end" not in caplog.text


@pytest.mark.parametrize("n_out", [2, 5, 17])
def test_http_answer_whose_tokens_all_came_in_one_counted_chunk_has_no_tpot(caplog, n_out: int) -> None:
    """One chunk carrying the whole text and a count of n_out > 1 (a server that streams the answer in
    one piece, or one that coalesced every step into one chunk): the tokens arrived together, so no
    inter-token time was measured. It was timed as tokens with TPOT (t - t) / (n_out - 1) = 0.0, a
    perfect TPOT that met any SLO and pulled the percentiles down."""
    chunk = {**_text("x" * n_out), "usage": {"prompt_tokens": 3, "completion_tokens": n_out}}
    for rec in _replay([chunk, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n_out}}]):
        assert rec.error is None and rec.output_tokens == n_out and rec.ttft is not None and rec.ttft == rec.latency, rec
        assert rec.tpot is None, rec


def test_http_stream_with_nothing_in_it_is_an_error() -> None:
    for rec in _replay([{"choices": []}]):
        assert rec.error is not None and "no tokens" in rec.error and rec.ttft is None


def test_http_error_replies_are_recorded_by_their_message() -> None:
    """A refused request's record kept the reply's first 200 bytes, cut mid-JSON ('..."code":"context_l');
    now the server's own message, whole up to 300 characters."""
    from runtime.bench.replay import _error_text

    long = "x" * 400
    assert _error_text('{"error": {"message": "prompt too long", "type": "invalid_request_error", "code": "context_length_exceeded"}}') == \
        "prompt too long (context_length_exceeded)"
    assert _error_text('{"error": {"message": "gone", "code": 404}}') == "gone"
    assert _error_text('{"detail": "Not Found"}') == "Not Found"
    assert _error_text('{"detail": [{"loc": ["body"], "msg": "bad"}]}') == '[{"loc": ["body"], "msg": "bad"}]'
    assert _error_text("  plain\n text ") == "plain text"
    assert _error_text(f'{{"error": {{"message": "{long}"}}}}') == "x" * 297 + "..."
    assert _error_text("[1, 2]") == "[1, 2]"
