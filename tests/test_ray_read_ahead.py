"""The Ray ingress takes each replica stream off the wire as it arrives (``read_ahead``): a consumer
that stops reading leaves a merged output or two at the ingress, not one Ray object per step
(Serve's streaming calls have no backpressure: the replica pushes every item to the ingress, read
or not; measured with a real Serve deployment, 20000 unread items held 20000 objects, 10 MB of
store and +47 MB of RSS at the caller). A client that goes away cancels the replica's stream at once."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest

pytest.importorskip("ray")

from runtime.distributed.replica import on_the_wire  # noqa: E402
from runtime.distributed.replica_set import ReplicaSetEngine  # noqa: E402
from runtime.output_mailbox import OutputMailbox  # noqa: E402
from runtime.request import RequestOutput, SamplingParams  # noqa: E402
from tests.test_ray_sync import replica, service  # noqa: E402,F401 - the in-process replica fixtures


def step_output(n: int, finished: bool = False) -> RequestOutput:
    """The replica engine's output after its n-th token (token 100 + k, text one "ab" per token)."""
    ids = tuple(range(100, 100 + n))
    return RequestOutput("req", None, ids[-1:], "ab", ids, "ab" * n, finished, "length" if finished else None, None, (1, 2, 3))


class ReplicaStream:
    """One replica ``generate`` call as the ingress sees it: async-iterable items, and ``cancel``
    (Serve's, which cancels the replica's generator). Each item is awaited, as a Ray stream's are."""

    def __init__(self, outputs: int, then_wait: bool) -> None:
        self.outputs, self.then_wait = outputs, then_wait
        self.taken = 0
        self.drained = asyncio.Event()
        self.cancelled = False
        self.closed = False

    async def _items(self) -> AsyncIterator[tuple]:
        try:
            for n in range(1, self.outputs + 1):
                await asyncio.sleep(0)  # the next object arrives
                self.taken = n
                last = n == self.outputs and not self.then_wait
                yield ("out", on_the_wire(step_output(n, last), step_output(n - 1) if n > 1 else None), None)
            self.drained.set()
            if self.then_wait:
                await asyncio.Event().wait()  # the replica's request goes on; nothing more arrives yet
        finally:
            self.closed = True

    def __aiter__(self) -> AsyncIterator[tuple]:
        return self._items()

    def cancel(self) -> None:
        self.cancelled = True


def ingress_with(stream: ReplicaStream, model_dir: Path) -> ReplicaSetEngine:
    handle = SimpleNamespace(generate=SimpleNamespace(remote=lambda *args: stream))
    handle.options = lambda **options: handle
    return ReplicaSetEngine(handle, None, str(model_dir), "tiny", 64)


def test_a_stream_nobody_reads_is_taken_off_the_wire_and_merged(tiny_llama_dir: Path) -> None:
    """It used to be read only as fast as its client read: the replica's items waited in Ray."""
    steps = 300

    async def run() -> list[RequestOutput]:
        replica = ReplicaStream(steps, then_wait=False)
        stream = ingress_with(replica, tiny_llama_dir).generate("req", "hi", SamplingParams(max_tokens=steps, ignore_eos=True))
        outs = [await stream.__anext__()]
        try:
            await asyncio.wait_for(replica.drained.wait(), 10)  # while the client reads nothing more
        except asyncio.TimeoutError:
            pytest.fail(f"the ingress took {replica.taken} of {steps} items off the wire while its client read nothing")
        outs += [out async for out in stream]
        return outs

    outs = asyncio.run(run())
    assert len(outs) <= 2 + OutputMailbox.KEEP_SEPARATE, [len(o.new_token_ids) for o in outs]
    final = outs[-1]
    assert final.finished and final.token_ids == tuple(range(100, 100 + steps)) and final.text == "ab" * steps
    assert sum((tuple(o.new_token_ids) for o in outs), ()) == final.token_ids  # nothing lost
    assert "".join(o.new_text for o in outs) == final.text


def test_a_client_gone_mid_stream_cancels_the_replica_stream_at_once(tiny_llama_dir: Path) -> None:
    async def run() -> ReplicaStream:
        replica = ReplicaStream(3, then_wait=True)
        stream = ingress_with(replica, tiny_llama_dir).generate("req", "hi", SamplingParams(max_tokens=50))
        await asyncio.wait_for(stream.__anext__(), 10)
        await asyncio.wait_for(stream.aclose(), 10)  # what the server does when the client hangs up
        return replica

    replica = asyncio.run(run())
    assert replica.cancelled and replica.closed  # Serve's cancel reaches the replica, whose engine aborts the request


class LocalReplicaStream:
    """A real replica's ``generate`` called in-process, as a Serve stream: iterating it runs the
    replica's generator in the reading task, so cancelling that task (as Serve's ``cancel`` does
    the replica's) reaches the replica's clean-up, which aborts the engine request."""

    def __init__(self, items: AsyncIterator[tuple]) -> None:
        self.items = items

    def __aiter__(self) -> AsyncIterator[tuple]:
        return self.items

    def cancel(self) -> None:
        pass


def test_a_client_gone_mid_stream_aborts_the_request_in_the_replica_s_engine(replica, tiny_llama_dir: Path) -> None:
    """Through the ingress's read-ahead, a real replica and its engine: the request ends as an
    abort long before its 40 slowed steps (2 s) are done."""
    finished: list[Any] = []
    replica.engine.add_observer(finished.append)
    runner = replica.engine.engine.runner
    real_execute = runner.execute
    runner.execute = lambda steps: (time.sleep(0.05), real_execute(steps))[1]
    handle = SimpleNamespace(generate=SimpleNamespace(remote=lambda *args: LocalReplicaStream(replica.generate(*args))))
    handle.options = lambda **options: handle
    ingress = ReplicaSetEngine(handle, None, str(tiny_llama_dir), "tiny", 64)

    async def run() -> None:
        stream = ingress.generate("req", "hello there", SamplingParams(max_tokens=40, ignore_eos=True))
        first = await asyncio.wait_for(stream.__anext__(), 30)
        assert not first.finished
        await asyncio.wait_for(stream.aclose(), 10)

    try:
        asyncio.run(run())
        deadline = time.monotonic() + 10
        while not finished and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        runner.execute = real_execute
    assert [(m.finish_reason, m.output_tokens < 40) for m in finished] == [("abort", True)], finished
