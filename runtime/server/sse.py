"""Server-sent events framing for streamed completions, and the response that sends them."""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def event(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that closes its events generator when it ends, however it
    ends, so the generator's cleanup (closing the engine streams, which aborts their requests)
    runs now.

    Starlette's ``StreamingResponse`` leaves the generator suspended where it last yielded when
    the response ends early: a client that stopped reading (its transport paused, ``send``
    waiting for it to drain) and then hung up gets the handler cancelled inside ``send``, not
    inside the generator. Its requests then went on generating for nobody, holding their KV
    blocks, until the garbage collector finalised the generator."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: the cancellation that ended the response (anyio repeats its own) must not cut the close short.
            await asyncio.shield(self.body_iterator.aclose())  # type: ignore[union-attr]
