"""Exceptions between paired operations: an interrupt (Ctrl-C in ``LLM.generate``) or an error
raised half-way through admission or a step must leave no KV block, in-flight prefix count,
adapter device reference, demand or reader behind, and the next request must give the tokens
it gives on a fresh engine."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.llm import LLM
from runtime.request import SamplingParams
from tests.faults.conftest import idle_problems

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 3 + 4 * 3 + 2))  # three full 4-token blocks, then two tokens


def make_llm(model: Path, adapters: dict[str, Path], **overrides: Any) -> LLM:
    values: dict[str, Any] = dict(device="cpu", num_kv_blocks=32, block_size=4, max_model_len=64, max_loras=1, max_cpu_loras=2,
                                  max_lora_rank=16, enable_prefix_caching=True)  # fmt: skip
    values.update(overrides)
    return LLM(str(model), adapters={name: str(adapters[name]) for name in ("a", "b")}, **values)


def fresh_tokens(model: Path, adapters: dict[str, Path], adapter: str | None) -> tuple[int, ...]:
    with make_llm(model, adapters) as llm:
        return llm.generate([PROMPT], GREEDY, adapter=adapter)[0].token_ids


def idle(llm: LLM) -> list[str]:
    engine = llm.engine
    problems = idle_problems(engine.snapshot())
    bm = engine.block_manager
    if bm._in_flight or bm._to_publish or bm._tables:
        problems.append(f"block manager keeps in_flight={len(bm._in_flight)} to_publish={len(bm._to_publish)} tables={len(bm._tables)}")
    for name in ("a", "b"):
        ref = engine.registry.resolve(name)
        if engine.registry.readers(ref) or engine.pool.device_refs_of(ref) or engine.pool.demand_of(ref):
            problems.append(f"adapter {name} still referenced")
    return problems


def test_an_interrupt_during_admission_leaves_no_device_reference(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], monkeypatch) -> None:
    """Ctrl-C while the scheduler hashed an admitted prompt (``acquire_prefix``, after the adapter's
    device slot was taken): the abort found the request still waiting and released no slot, so the
    adapter stayed pinned; with max_loras=1 no other adapter could ever run (the next generate hung)."""
    expected = fresh_tokens(tiny_llama_dir, tiny_adapters, "b")
    with make_llm(tiny_llama_dir, tiny_adapters) as llm:
        bm = llm.engine.block_manager
        real = bm.acquire_prefix

        def interrupted(*args: Any, **kwargs: Any) -> int:
            monkeypatch.setattr(bm, "acquire_prefix", real)
            raise KeyboardInterrupt  # lands while the prompt is hashed

        monkeypatch.setattr(bm, "acquire_prefix", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([PROMPT], GREEDY, adapter="a")
        assert idle(llm) == []
        (out,) = llm.generate([PROMPT], GREEDY, adapter="b")
        assert out.finish_reason == "length" and out.token_ids == expected
        assert idle(llm) == []


class _InterruptOnSet(dict):
    """The block manager's in-flight counts, raising KeyboardInterrupt on the ``nth`` store."""

    def __init__(self, nth: int) -> None:
        super().__init__()
        self.left = nth

    def __setitem__(self, key: Any, value: Any) -> None:
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt
        super().__setitem__(key, value)


def test_an_interrupt_while_prompt_blocks_are_marked_in_flight_leaves_counts_balanced(tiny_llama_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    """Ctrl-C in ``acquire_prefix`` after the blocks to publish were recorded but before each was
    counted in flight: freeing the sequence then uncounted a block never counted (KeyError), so
    the abort failed half-way with the sequence's KV blocks never returned."""
    expected = fresh_tokens(tiny_llama_dir, tiny_adapters, None)
    with make_llm(tiny_llama_dir, tiny_adapters) as llm:
        bm = llm.engine.block_manager
        bm._in_flight = _InterruptOnSet(nth=2)  # the first block is counted, the second is not
        with pytest.raises(KeyboardInterrupt):
            llm.generate([PROMPT], GREEDY)
        assert idle(llm) == []
        bm._in_flight = {}
        assert llm.generate([PROMPT], GREEDY)[0].token_ids == expected
        assert idle(llm) == []


@pytest.mark.parametrize("owner, method", [("registry", "release"), ("sampler", "remove")])
def test_an_interrupt_while_a_finished_request_is_released_releases_it_once(
    owner: str, method: str, tiny_llama_dir: Path, tiny_adapters: dict[str, Path], monkeypatch
) -> None:
    """Ctrl-C in the middle of ``_finish`` (its adapter's demand given back, its reader not yet):
    ``LLM.generate``'s abort of the request, still in flight, released it a second time. The
    demand went negative, an AssertionError hid the KeyboardInterrupt, and the reader stayed
    (a request sharing the adapter would instead have lost its demand silently)."""
    expected = fresh_tokens(tiny_llama_dir, tiny_adapters, "a")
    with make_llm(tiny_llama_dir, tiny_adapters) as llm:
        target = getattr(llm.engine, owner)
        real = getattr(target, method)

        def interrupted(*args: Any, **kwargs: Any) -> None:
            monkeypatch.setattr(target, method, real)
            raise KeyboardInterrupt  # lands half-way through the release

        monkeypatch.setattr(target, method, interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([PROMPT], GREEDY, adapter="a")
        assert idle(llm) == []
        assert not llm.engine.has_unfinished()
        (out,) = llm.generate([PROMPT], GREEDY, adapter="a")
        assert out.finish_reason == "length" and out.token_ids == expected
        assert idle(llm) == []
