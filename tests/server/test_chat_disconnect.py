"""A chat client that goes away while its request waits for admission aborts that request."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator

import httpx
import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server_harness import running_server


class _SlowAdmission:
    """The shared engine, except that a request's first output waits until the test cancels it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.cancelled = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def generate(self, request_id: str, prompt: Any, params: Any, adapter: Any) -> AsyncIterator[Any]:
        try:
            await asyncio.Event().wait()  # never admitted: only a cancellation ends this
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        yield None  # pragma: no cover


@pytest.mark.parametrize("stream", [False, True])
def test_chat_client_gone_during_admission_cancels_it(engine, stream: bool) -> None:
    proxy = _SlowAdmission(engine)
    with running_server(create_app(proxy, ServerOptions())) as url:
        body = {"model": engine.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=0.5)
        assert proxy.cancelled.wait(5), "the pending admission was not cancelled when the client went away"
