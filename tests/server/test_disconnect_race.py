"""A client noticed gone just as admission finished: the opened streams are closed at once."""
from __future__ import annotations

import asyncio

import pytest

from runtime.server import generation as gen
from runtime.server.errors import APIError


class _Stream:
    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


class _GoneWhileChecking:
    """``is_disconnected`` finds the client gone, but only after the awaited work has finished."""

    def __init__(self, work_done: asyncio.Event) -> None:
        self.work_done = work_done

    async def is_disconnected(self) -> bool:
        await self.work_done.wait()
        await asyncio.sleep(0)
        return True


def test_result_finished_during_the_disconnect_check_is_released():
    async def scenario() -> list[_Stream]:
        done = asyncio.Event()
        streams = [_Stream(), _Stream()]

        async def admission():
            await asyncio.sleep(0.01)
            done.set()
            return [(None, s) for s in streams]

        with pytest.raises(APIError) as exc:
            await gen.until_disconnected(_GoneWhileChecking(done), admission(), poll_s=0.001, release=gen.close_streams)
        assert exc.value.status == 499
        return streams

    assert all(s.closed for s in asyncio.run(scenario()))


def test_close_streams_closes_every_stream_even_if_one_fails():
    class _Broken(_Stream):
        async def aclose(self) -> None:
            raise RuntimeError("close failed")

    streams = [_Stream(), _Broken(), _Stream()]
    with pytest.raises(RuntimeError, match="close failed"):
        asyncio.run(gen.close_streams([(None, s) for s in streams]))
    assert streams[0].closed and streams[2].closed


def test_result_finished_before_a_cancellation_is_released():
    """The handler is cancelled (the server drops the connection) after the work finished but before
    it was handed over: the streams are closed, not left to the garbage collector."""

    async def scenario() -> list[_Stream]:
        streams = [_Stream()]
        checking, done = asyncio.Event(), asyncio.Event()

        async def admission():
            await checking.wait()  # finishes while the disconnect check is pending
            done.set()
            return [(None, s) for s in streams]

        class _SlowCheck:
            async def is_disconnected(self) -> bool:
                checking.set()
                await asyncio.sleep(10)
                return False

        waiter = asyncio.ensure_future(gen.until_disconnected(_SlowCheck(), admission(), poll_s=0.0, release=gen.close_streams))
        await done.wait()
        await asyncio.sleep(0)
        assert not waiter.done()
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        return streams

    assert all(s.closed for s in asyncio.run(scenario()))
