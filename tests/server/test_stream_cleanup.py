"""Engine streams are closed as soon as a response ends, however it ends: a streaming client that
stopped reading and then hung up, or one choice of several that failed. Leaving them to the
garbage collector (off in these tests) left their requests generating for nobody."""
from __future__ import annotations

import asyncio
import gc
import json
import time
from typing import Any

import pytest

from runtime.server.app import create_app
from runtime.request import RequestOutput
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for

pytestmark = pytest.mark.anyio


async def _stream_then_stall(app: Any, route: str, body: dict) -> None:
    """Run ``app`` for one streamed POST whose transport stops draining after the first body
    chunk (the client stopped reading: uvicorn's send waits in ``flow.drain()``), then report
    the client gone, as uvicorn does from connection_lost."""
    first_chunk, gone = asyncio.Event(), asyncio.Event()
    payload = json.dumps({**body, "stream": True}).encode()
    requests = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await first_chunk.wait()
        gone.set()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            first_chunk.set()
            await asyncio.Event().wait()  # the transport's buffer is full: only a cancellation ends this

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": route, "raw_path": route.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    assert gone.is_set()


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_a_stalled_stream_whose_client_hangs_up_aborts_its_request(engine, route: str) -> None:
    """The handler was cancelled inside ``send``, leaving the events generator suspended: nothing
    closed the engine stream, and the request generated all its tokens for nobody (the garbage
    collector, off here, might have finalised the generator some time later)."""
    finished: list = []
    engine.add_observer(finished.append)
    runner = engine.engine.runner
    real_execute = runner.execute
    runner.execute = lambda steps: (time.sleep(0.05), real_execute(steps))[1]  # 40 tokens take 2 s: the abort comes first
    gc.disable()
    try:
        body = {"model": engine.model_name, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
        body.update({"prompt": "hello"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
        await _stream_then_stall(create_app(engine, ServerOptions()), route, body)
        while not finished:
            await asyncio.sleep(0.01)
        assert [m.finish_reason for m in finished] == ["abort"]
    finally:
        gc.enable()
        runner.execute = real_execute
        engine.engine._observers.remove(finished.append)  # noqa: SLF001 - the engine is shared by the module


class _SecondChoiceOutlives:
    """The shared engine, except that choice 0 fails at once while choice 1 runs until its stream is closed."""

    admission_group = None  # generate takes no group: each choice is admitted alone

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.closed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def generate(self, request_id: str, prompt: Any, params: Any, adapter: Any) -> Any:
        if request_id.endswith("-0"):
            yield RequestOutput(request_id, None, (), "", (), "", True, "error", "boom", (1, 2), error_kind="engine")
            return
        ids: tuple[int, ...] = ()
        try:
            while True:
                ids += (5,)
                yield RequestOutput(request_id, None, (5,), "a", ids, "a" * len(ids), False, None, None, (1, 2))
                await asyncio.sleep(0.001)
        finally:
            self.closed.append(request_id)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_a_choice_that_outlives_a_failed_one_is_closed_with_the_response(engine, route: str, stream: bool) -> None:
    """A failed choice ends the response (a 500, or an error event); the ``async for`` it broke out
    of left the merge of the choices suspended, so the other choice's request ran on."""
    proxy = _SecondChoiceOutlives(engine)
    body = {"model": engine.model_name, "max_tokens": 8, "n": 2, "stream": stream}
    body.update({"prompt": "hello"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    gc.disable()
    try:
        async with client_for(create_app(proxy, ServerOptions())) as c:
            r = await c.post(route, json=body)
        assert r.status_code == (200 if stream else 500), r.text
        if stream:
            assert '"code":"engine_error"' in r.text and r.text.endswith("data: [DONE]\n\n")
        assert len(proxy.closed) == 1 and proxy.closed[0].endswith("-1")
    finally:
        gc.enable()
