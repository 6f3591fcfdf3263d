"""A request's outputs that its consumer has not read are merged (OutputMailbox), so a stream
nobody reads holds a few outputs, not one full copy per step."""
from __future__ import annotations

import asyncio
import random
import sys
import threading
from pathlib import Path

import pytest

from runtime.async_engine import AsyncLLMEngine
from runtime.config import EngineConfig
from runtime.output_mailbox import OutputMailbox
from runtime.request import RequestOutput, SamplingParams
from runtime.server.generation import merge_streams


def _step_outputs(request_id: str, pieces: list[tuple[tuple[int, ...], str]], finish: str | None = "length") -> list[RequestOutput]:
    """The outputs an engine would make for these (new ids, new text) steps, the last one finished."""
    outs, ids, text = [], (), ""
    for k, (new_ids, new_text) in enumerate(pieces):
        ids, text = ids + new_ids, text + new_text
        last = k == len(pieces) - 1 and finish is not None
        outs.append(RequestOutput(request_id, None, new_ids, new_text, ids, text, last, finish if last else None, None, (1, 2)))
    return outs


def _random_pieces(rng: random.Random, steps: int) -> list[tuple[tuple[int, ...], str]]:
    # A step can add no text (held back for a stop string or an incomplete character) and, rarely, no token.
    return [(tuple(rng.randrange(100) for _ in range(rng.choice((0, 1, 1, 2)))), "".join(rng.choice("ab ") for _ in range(rng.randrange(4))))
            for _ in range(steps)]  # fmt: skip


def test_outputs_left_unread_merge_into_the_latest_with_every_step_s_new_part() -> None:
    async def main() -> None:
        rng = random.Random(7)
        for _ in range(50):
            outs = _step_outputs("r", _random_pieces(rng, rng.randrange(1, 60)))
            box = OutputMailbox()
            read: list[RequestOutput] = []
            for out in outs:  # a consumer that reads now and then
                box.put(out)
                if rng.random() < 0.08:
                    read.append(await box.get())
            while len(box):
                read.append(await box.get())
            assert read[-1].finished and read[-1].token_ids == outs[-1].token_ids and read[-1].text == outs[-1].text
            assert sum((o.new_token_ids for o in read), ()) == outs[-1].token_ids
            assert "".join(o.new_text for o in read) == outs[-1].text
            for o in read:  # each one a consistent output: its new part ends its whole
                assert o.token_ids[len(o.token_ids) - len(o.new_token_ids) :] == o.new_token_ids and o.text.endswith(o.new_text)

    asyncio.run(main())


def test_an_unread_stream_holds_one_output_and_an_error_or_a_second_request_queues_unmerged() -> None:
    async def main() -> None:
        box = OutputMailbox()
        outs = _step_outputs("r", [((k,), "x") for k in range(200)], finish=None)
        for out in outs:
            box.put(out)
        keep = OutputMailbox.KEEP_SEPARATE
        assert len(box) == keep  # 200 steps: the first ones as they came, the rest merged into the last
        error = RequestOutput("r", None, (), "", (), "", True, "error", "engine step failed", ())
        box.put(error)
        assert len(box) == keep + 1
        assert [await box.get() for _ in range(keep - 1)] == outs[: keep - 1]
        merged = await box.get()
        assert merged.new_token_ids == tuple(range(keep - 1, 200)) and merged.new_text == "x" * (201 - keep) and not merged.finished
        assert merged.token_ids == outs[-1].token_ids and merged.text == outs[-1].text
        assert await box.get() is error
        for k in range(keep - 1):
            box.put(outs[k])
        done = _step_outputs("a", [((1,), "a")])[0]
        box.put(done)
        box.put(_step_outputs("b", [((2,), "b")])[0])  # another request's output never merges into this one's end
        assert len(box) == keep + 1 and [await box.get() for _ in range(keep)][-1] is done

    asyncio.run(main())


def test_get_waits_for_the_next_put() -> None:
    async def main() -> None:
        box = OutputMailbox()
        getter = asyncio.ensure_future(box.get())
        await asyncio.sleep(0.01)
        assert not getter.done()
        out = _step_outputs("r", [((1,), "a")])[0]
        asyncio.get_running_loop().call_soon(box.put, out)
        assert await asyncio.wait_for(getter, 5) is out

    asyncio.run(main())


def test_a_consumer_that_reads_late_gets_few_outputs_that_add_up(tiny_llama_dir: Path) -> None:
    """Through the engine: a consumer that sleeps while 48 tokens are generated reads them in at
    most KEEP_SEPARATE outputs after the first (one per step before), and the parts add up."""
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_loras=2, max_lora_rank=16, max_cpu_loras=4,
                          max_num_seqs=8, max_model_len=96, block_size=8, num_kv_blocks=64, max_num_batched_tokens=256)  # fmt: skip
    engine = AsyncLLMEngine(config)
    finished = threading.Event()
    engine.add_observer(lambda metrics: finished.set())

    async def main() -> list[RequestOutput]:
        stream = engine.generate("late", [5, 6, 7], SamplingParams(max_tokens=48, ignore_eos=True, logprobs=1))
        outs = [await stream.__anext__()]
        await asyncio.to_thread(finished.wait, 60)  # the engine runs ahead, the consumer reads nothing
        await asyncio.sleep(0.05)  # the last hand-overs reach the loop
        outs += [out async for out in stream]
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    final = outs[-1]
    assert final.finished and len(final.token_ids) == 48
    assert sum((o.new_token_ids for o in outs), ()) == final.token_ids
    assert "".join(o.new_text for o in outs) == final.text
    assert [lp.token_id for o in outs for lp in o.new_logprobs] == list(final.token_ids)
    assert len(outs) <= 2 + OutputMailbox.KEEP_SEPARATE, [len(o.new_token_ids) for o in outs]


def test_merge_streams_holds_at_most_one_output_per_stream_while_its_consumer_lags() -> None:
    """The server's fan-in of a request's choices must not buffer what the engine's mailboxes merge."""

    async def main() -> None:
        produced = [0, 0]

        async def stream(index: int):  # type: ignore[no-untyped-def]
            for k in range(100):
                produced[index] += 1
                yield k

        async def first_and_rest(index: int):  # type: ignore[no-untyped-def]
            rest = stream(index)
            return await rest.__anext__(), rest

        streams = [await first_and_rest(0), await first_and_rest(1)]
        merged = merge_streams(streams)
        assert (await merged.__anext__())[1] == 0
        await asyncio.sleep(0.05)  # the consumer lags: the pumps must wait for it
        assert sum(produced) <= 2 + 2 * 2, produced
        rest = [item async for item in merged]
        assert sorted(k for i, k in [(0, 0)] + rest if i == 0) == list(range(100))
        assert sorted(k for i, k in [(0, 0)] + rest if i == 1) == list(range(100))

    asyncio.run(main())


def test_merge_streams_forwards_a_stream_s_own_errors_cancellation_included() -> None:
    async def failing(err: BaseException):  # type: ignore[no-untyped-def]
        yield 2
        raise err

    async def fine():  # type: ignore[no-untyped-def]
        for k in range(3):
            yield k
            await asyncio.sleep(0.01)

    async def collect(err: BaseException) -> list:
        streams = []
        for stream in (failing(err), fine()):
            streams.append((await stream.__anext__(), stream))
        return [item async for item in merge_streams(streams)]

    async def main() -> None:
        with pytest.raises(KeyError):
            await asyncio.wait_for(collect(KeyError("x")), 10)
        with pytest.raises(asyncio.CancelledError):  # it used to hang: the pump took it for its own cancellation
            await asyncio.wait_for(collect(asyncio.CancelledError()), 10)

    asyncio.run(main())


def test_an_unread_stream_holds_nothing_per_step_it_missed() -> None:
    """Merged outputs used to keep each step's new ids and text until read (joined on get): about
    110 bytes a token for a stream nobody reads. Now the merged entry is the latest output and
    where its new part starts; what the box holds beyond the outputs themselves stays flat."""
    import tracemalloc

    steps = 5000

    def step(k: int) -> RequestOutput:  # the output of step k; range and str stand in for the engine's tuple and text
        return RequestOutput("r", None, (k,), "x", range(k + 1), "x" * (k + 1), False, None, None, (1,))

    async def main() -> None:
        box = OutputMailbox()
        tracemalloc.start()
        try:
            for k in range(steps):
                box.put(step(k))
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        last = sys.getsizeof(step(steps - 1).text)
        assert held < last + 16_384, f"{held} bytes held for {steps} steps (the last output's text alone: {last})"
        outs = [await box.get() for _ in range(len(box))]
        assert "".join(o.new_text for o in outs) == step(steps - 1).text
        assert sum((tuple(o.new_token_ids) for o in outs), ()) == tuple(range(steps))

    asyncio.run(main())
