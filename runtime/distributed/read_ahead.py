"""read_ahead: take a replica's outputs off the wire as they arrive, merging what the ingress's
routes have not taken yet, so a consumer that lags cannot make the ingress hold one object per step.

A replica's ``generate`` is a Serve streaming call: a Ray streaming generator, which Serve
starts without ``_generator_backpressure_num_objects``. The replica pushes every item to the
ingress (the generator's owner) as soon as it is made, whether or not anyone reads it; and Serve
runs the replica's generator in its own task that puts each item on an unbounded queue, so even
Ray's backpressure would only move the pile to the replica. A stream the ingress read slower
than the replica generated therefore left every step's output in the ingress's object store
until it was read: one small object (~0.5 KB of store, ~2.4 KB of RSS, measured with a Serve
deployment) per generated token.

What this does not bound: an HTTP client that stops reading. The ingress's ASGI ``send`` only
queues each message for Serve's HTTP proxy (Serve's replica wrapper, ``MessageQueue.put_nowait``),
so the routes never wait for the client and take outputs as fast as they come; the SSE chunks then
wait in the proxy, which this process cannot see (docs/scale-out.md says so). Here the merging
matters when the ingress's event loop falls behind its replicas (many streams, a long /metrics).

Here the ingress reads each stream as it arrives and keeps what its consumer has not taken in an
``OutputMailbox``, which merges it as the single server's engine does for its own streams: a
stream holds at most ``OutputMailbox.KEEP_SEPARATE`` outputs whatever the backlog, and a client
that lags gets fewer, larger chunks, with nothing lost. The costs: a task per stream, and per
item a mailbox put and get (a deque append and pop, an event set), a few microseconds.

Closing the stream (the client went away) cancels the reading task at once, which cancels the
replica's stream (``ReplicaSetEngine._generate``'s clean-up), aborting the request there.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from runtime.output_mailbox import OutputMailbox
from runtime.request import RequestOutput


async def read_ahead(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """``outputs``, read as fast as they come; the consumer gets them merged when it lags. An
    error ``outputs`` raises reaches the consumer after the outputs before it."""
    box = OutputMailbox()

    async def pump() -> None:
        try:
            async for out in outputs:
                box.put(out)
        except BaseException as err:  # the stream's own error (a CancelledError too): forwarded to the consumer
            box.end(err)
            if isinstance(err, asyncio.CancelledError) and asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise  # ours: the consumer is closing
        else:
            box.end(StopAsyncIteration())

    reader = asyncio.create_task(pump())
    try:
        while True:
            try:
                out = await box.get()
            except StopAsyncIteration:
                return
            yield out
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await outputs.aclose()  # type: ignore[attr-defined]
