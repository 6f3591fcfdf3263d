"""A long text prompt is encoded without holding the GIL and outside the engine's lock, so other
streams go on while it is read (a ~1 MiB prompt takes about a second to encode, and it used to be
encoded under the lock at admission, after a first time on the event loop)."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import pytest

import runtime.tokenizer as tokenizer_module
from runtime.async_engine import AsyncLLMEngine, EngineDeadError, GroupRefused
from runtime.config import EngineConfig
from runtime.request import PromptTooLongError, SamplingParams
from runtime.tokenizer import LONG_TEXT_CHARS, Tokenizer


def _long_text(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["the", "adapter", "ünïcödé", "🙂", "</s>", "serving", "a", "\n", "  ", "LoRA", "<s>", "rank"]
    parts, n = [], 0
    while n < chars:
        parts.append(rng.choice(words))
        n += len(parts[-1]) + 1
    return " ".join(parts)


def test_a_long_text_encodes_to_the_same_ids_and_spans(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = Tokenizer(tiny_llama_dir)
    text = _long_text(LONG_TEXT_CHARS + 5000)
    long_path = [tok.encode(text), tok.encode(text, add_special_tokens=False), tok.encode_with_spans(text)]
    monkeypatch.setattr(tokenizer_module, "LONG_TEXT_CHARS", 10**12)  # every text through the short path
    assert long_path == [tok.encode(text), tok.encode(text, add_special_tokens=False), tok.encode_with_spans(text)]


def test_other_threads_run_while_a_long_text_is_encoded(tiny_llama_dir: Path) -> None:
    tok = Tokenizer(tiny_llama_dir)
    text = _long_text(1 << 18)
    ticks, stop = [], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    spinner = threading.Thread(target=spin)
    spinner.start()
    time.sleep(0.05)
    start = time.perf_counter()
    tok.encode(text)
    end = time.perf_counter()
    stop.set()
    spinner.join()
    during = [t for t in ticks if start < t < end]
    assert len(during) >= 3, f"the spinner ran {len(during)} times in the {end - start:.2f} s encode: the GIL was held"


def _config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), device="cpu", dtype="float32", max_loras=2, max_lora_rank=16, max_cpu_loras=4,
                        max_num_seqs=8, max_model_len=96, block_size=8, num_kv_blocks=64, max_num_batched_tokens=256)  # fmt: skip


class _GatedEncode:
    """The engine's tokenizer, except that encoding a long text waits (up to 20 s) for ``go``."""

    def __init__(self, inner: Tokenizer) -> None:
        self._inner = inner
        self.go = threading.Event()
        self.started = threading.Event()
        self.waited_out = False

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._inner, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= LONG_TEXT_CHARS:
            self.started.set()
            self.waited_out = not self.go.wait(20)
        return self._inner.encode(text, add_special_tokens)


def test_streams_go_on_while_a_long_prompt_is_encoded_and_it_is_refused_by_its_length(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine(_config(tiny_llama_dir))
    gate = _GatedEncode(engine.engine.tokenizer)
    engine.engine.tokenizer = gate

    async def other_stream() -> int:  # the tokens it got
        got = 0
        async for out in engine.generate("other", [5, 6, 7], SamplingParams(max_tokens=80, ignore_eos=True)):
            got += len(out.new_token_ids)
            if gate.started.is_set():
                after = getattr(other_stream, "after", 0) + 1
                other_stream.after = after  # type: ignore[attr-defined]
                if after == 3:  # three outputs while the long prompt is being encoded: the lock was free
                    gate.go.set()
        return got

    async def main() -> None:
        other = asyncio.ensure_future(other_stream())
        with pytest.raises(PromptTooLongError, match="max_model_len"):
            async for _ in engine.generate("long", _long_text(1 << 16), SamplingParams(max_tokens=4)):
                pass
        assert await other == 80

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
    assert not gate.waited_out, "no other output came while the long prompt was encoded: it held the engine's lock"


def test_a_long_prompt_refused_before_it_joins_its_group_refuses_the_group(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine(_config(tiny_llama_dir))
    bad = _long_text(LONG_TEXT_CHARS) + "\ud800"  # a lone surrogate: the encoding refuses it

    async def drain(stream) -> list:  # type: ignore[no-untyped-def]
        return [out async for out in stream]

    async def main() -> None:
        group = engine.admission_group(3)
        first = asyncio.ensure_future(drain(engine.generate("g-0", [5, 6, 7], SamplingParams(max_tokens=4), group=group)))
        second = asyncio.ensure_future(drain(engine.generate("g-1", bad, SamplingParams(max_tokens=4), group=group)))
        results = await asyncio.gather(first, second, return_exceptions=True)
        assert isinstance(results[0], GroupRefused) and "g-1" in str(results[0]), results
        assert isinstance(results[1], ValueError) and "Unicode" in str(results[1]), results
        with pytest.raises(GroupRefused):  # one that comes later is refused too
            await drain(engine.generate("g-2", [5, 6], SamplingParams(max_tokens=4), group=group))
        assert not engine._parked

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()


def test_a_group_member_cancelled_while_its_long_prompt_is_encoded_lets_the_others_run(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine(_config(tiny_llama_dir))
    gate = _GatedEncode(engine.engine.tokenizer)
    engine.engine.tokenizer = gate

    async def drain(stream) -> list:  # type: ignore[no-untyped-def]
        return [out async for out in stream]

    async def main() -> None:
        group = engine.admission_group(2)
        first = asyncio.ensure_future(drain(engine.generate("g-0", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), group=group)))
        second = asyncio.ensure_future(drain(engine.generate("g-1", _long_text(LONG_TEXT_CHARS), SamplingParams(max_tokens=4), group=group)))
        await asyncio.to_thread(gate.started.wait, 20)
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        gate.go.set()  # its worker thread finishes; nobody takes the result
        outs = await asyncio.wait_for(first, 30)
        assert outs[-1].finished and len(outs[-1].token_ids) == 4
        assert not engine._parked

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        gate.go.set()
        engine.shutdown()


async def _drain(stream) -> list:  # type: ignore[no-untyped-def]
    return [out async for out in stream]


def test_a_member_refused_after_shutdown_failed_its_group_gets_its_own_error(tiny_llama_dir: Path) -> None:
    """shutdown() fails the parked group first; the member still encoding is then refused with
    its own error, not a RuntimeError from a future that shutdown had already settled."""
    engine = AsyncLLMEngine(_config(tiny_llama_dir))
    gate = _GatedEncode(engine.engine.tokenizer)
    engine.engine.tokenizer = gate
    bad = _long_text(LONG_TEXT_CHARS) + "\ud800"

    async def main() -> list:
        group = engine.admission_group(2)
        first = asyncio.ensure_future(_drain(engine.generate("g-0", [5, 6, 7], SamplingParams(max_tokens=4), group=group)))
        second = asyncio.ensure_future(_drain(engine.generate("g-1", bad, SamplingParams(max_tokens=4), group=group)))
        await asyncio.to_thread(gate.started.wait, 20)
        await asyncio.to_thread(engine.shutdown_in_background(5.0).join)
        gate.go.set()
        return await asyncio.gather(first, second, return_exceptions=True)

    try:
        first, second = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        gate.go.set()
    assert isinstance(first, EngineDeadError), first
    assert type(second) is ValueError and "Unicode" in str(second), second


def test_a_member_cancelled_during_a_drain_does_not_queue_its_failed_group_again(tiny_llama_dir: Path) -> None:
    """shutdown_in_background() (a graceful drain) fails the parked group; the member still encoding
    is then cancelled. Its group must not be queued again: draining those settled tickets raised in
    whichever thread admitted them, and in the step thread that killed every request in flight."""
    engine = AsyncLLMEngine(_config(tiny_llama_dir))
    gate = _GatedEncode(engine.engine.tokenizer)
    engine.engine.tokenizer = gate
    real_step, release = engine.engine.step, threading.Event()

    def slow_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.01)  # keeps "other" running through the drain
        return real_step(*args, **kwargs)

    engine.engine.step = slow_step

    async def main() -> list:
        other = asyncio.ensure_future(_drain(engine.generate("other", [5, 6, 7], SamplingParams(max_tokens=80, ignore_eos=True))))
        group = engine.admission_group(2)
        first = asyncio.ensure_future(_drain(engine.generate("g-0", [5, 6, 7], SamplingParams(max_tokens=4), group=group)))
        second = asyncio.ensure_future(_drain(engine.generate("g-1", _long_text(LONG_TEXT_CHARS), SamplingParams(max_tokens=4), group=group)))
        await asyncio.to_thread(gate.started.wait, 20)
        for _ in range(4):  # the submit helpers busy: the step thread admits what is queued itself
            engine._submit.submit(release.wait, 5)
        drainer = engine.shutdown_in_background(30.0)
        await asyncio.sleep(0.1)
        second.cancel()
        results = await asyncio.gather(first, second, other, return_exceptions=True)
        release.set()
        gate.go.set()
        await asyncio.to_thread(drainer.join)
        return results

    try:
        first, second, other = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        gate.go.set()
        release.set()
    assert isinstance(first, EngineDeadError) and isinstance(second, asyncio.CancelledError), (first, second)
    assert not isinstance(other, BaseException) and other[-1].finish_reason == "length", other
    assert "step failed" not in (engine.dead_error or "")


def test_a_member_beyond_its_group_s_size_is_refused_with_its_own_error(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine(_config(tiny_llama_dir))
    bad = _long_text(LONG_TEXT_CHARS) + "\ud800"

    async def main() -> None:
        group = engine.admission_group(2)
        await asyncio.gather(*(_drain(engine.generate(f"g-{k}", [5, 6, 7], SamplingParams(max_tokens=4), group=group)) for k in range(2)))
        with pytest.raises(ValueError, match="Unicode"):
            await _drain(engine.generate("g-2", bad, SamplingParams(max_tokens=4), group=group))

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
