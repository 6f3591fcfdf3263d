"""API calls into a busy AsyncLLMEngine are served between steps, not after the batch.

The step thread held a plain Lock and re-took it right after every step, so an API call
(admission, abort, snapshot, adapter lookup) could wait until the whole batch finished.
Counted in engine steps, not seconds: a fair lock lets a call in within a step or two.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from runtime.async_engine import AsyncLLMEngine
from runtime.request import SamplingParams
from tests.faults.conftest import engine_config, idle_problems

MAX_STEPS_WAITED = 3  # the step in progress, plus slack for the call's own scheduling


def test_api_calls_get_the_lock_between_steps(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine(engine_config(tiny_llama_dir, max_model_len=256, num_kv_blocks=256))
    waited: list[int] = []

    async def scenario() -> None:
        async def generate(i: int) -> None:
            async for _ in engine.generate(f"long-{i}", [1 + i, 2, 3], SamplingParams(max_tokens=150, ignore_eos=True)):
                pass

        tasks = [asyncio.create_task(generate(i)) for i in range(6)]
        await asyncio.sleep(0.05)
        for _ in range(5):
            before = engine.engine.steps  # read without the lock: an int, only for counting
            snap = await asyncio.to_thread(engine.snapshot)
            waited.append(snap["steps"] - before)
            assert snap["running"] > 0  # answered while the batch is still running
        await asyncio.gather(*tasks)

    try:
        asyncio.run(scenario())
        assert max(waited) <= MAX_STEPS_WAITED, waited
        assert idle_problems(engine.snapshot()) == []
    finally:
        engine.shutdown()
