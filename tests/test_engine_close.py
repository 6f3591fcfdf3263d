"""LLMEngine.close and LLM.close: the timeout they give a disk read still running, which they check,
and a close called again from inside its own teardown, which raises instead of waiting for itself."""
from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import pytest

from runtime.engine import LLMEngine
from runtime.llm import LLM
from runtime.request import SamplingParams
from tests.engine_helpers import make_engine

BAD_TIMEOUTS = [-1, math.nan, True, "5"]


def stuck_pool_read(engine: LLMEngine, gate: threading.Event) -> None:
    """A disk read of the adapter pool's that waits for ``gate`` (a hung network mount)."""
    engine.pool._reader.submit("adapter 'x' (stuck)", gate.wait, 60)  # noqa: SLF001


def test_a_close_called_from_inside_its_own_teardown_raises_instead_of_waiting_for_itself(tiny_llama_dir: Path) -> None:
    """The close lock is not re-entrant: a teardown callback that closed the engine again (in the
    same thread) waited for its own lock for ever."""
    engine = make_engine(tiny_llama_dir)
    runner_release = engine.runner.release
    inner: list[BaseException] = []

    def release_that_closes_again() -> None:
        try:
            engine.close()
        except RuntimeError as err:
            inner.append(err)
        runner_release()

    engine.runner.release = release_that_closes_again
    closing = threading.Thread(target=engine.close, daemon=True)
    closing.start()
    closing.join(30)
    assert not closing.is_alive(), "close() from inside its own teardown waited for itself"
    assert len(inner) == 1 and "called again from inside its own teardown" in str(inner[0])
    assert engine.runner.model is None  # the outer close finished the teardown
    engine.close()  # and a later call, from this thread, returns at once


def test_engine_close_refuses_a_timeout_that_is_no_length_and_closes_nothing(tiny_llama_dir: Path) -> None:
    """A negative timeout was taken as no wait at all, NaN passed on to the wait; now each is a
    ValueError naming it, and the engine stays open."""
    engine = make_engine(tiny_llama_dir)
    for timeout in BAD_TIMEOUTS:
        with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
            engine.close(timeout)  # type: ignore[arg-type]
    assert engine.runner.model is not None
    engine.add_request("r", [5, 6, 7])  # still open
    engine.close()


def test_engine_close_with_an_infinite_timeout_waits_like_none(tiny_llama_dir: Path) -> None:
    """``math.inf`` overflowed the platform's timeout (OverflowError) when a read was running."""
    engine = make_engine(tiny_llama_dir)
    gate = threading.Event()
    stuck_pool_read(engine, gate)
    errors: list[BaseException] = []
    closing = threading.Thread(target=lambda: _record(errors, engine.close, math.inf), daemon=True)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive() and not errors, errors  # waits for the read
    gate.set()
    closing.join(30)
    assert not closing.is_alive() and not errors, errors
    assert engine.runner.model is None


def _record(errors: list[BaseException], fn, *args) -> None:  # type: ignore[no-untyped-def]
    try:
        fn(*args)
    except BaseException as err:  # noqa: BLE001 - the test reads it
        errors.append(err)


def llm(model: Path) -> LLM:
    return LLM(str(model), device="cpu", max_model_len=96, num_kv_blocks=64, block_size=8)


def test_llm_close_gives_a_stuck_read_its_timeout_then_releases_the_model(tiny_llama_dir: Path, caplog) -> None:
    """``LLM.close()`` called ``engine.close()`` without a timeout: a read stuck on a hung mount
    held it for ever. ``close(timeout=...)`` waits that long, then leaves the read with a WARNING."""
    offline = llm(tiny_llama_dir)
    gate = threading.Event()
    try:
        stuck_pool_read(offline.engine, gate)
        with caplog.at_level(logging.WARNING, logger="runtime.engine"):
            closing = threading.Thread(target=offline.close, kwargs={"timeout": 0.05}, daemon=True)
            closing.start()
            closing.join(30)
            assert not closing.is_alive(), "LLM.close(timeout=0.05) waited for the stuck read"
        assert any("adapter 'x' (stuck) (running)" in r.getMessage() for r in caplog.records), caplog.records
        assert offline.engine.runner.model is None
        with pytest.raises(RuntimeError, match="LLM: closed"):
            offline.generate("hello")
    finally:
        gate.set()


def test_llm_close_refuses_a_timeout_that_is_no_length_and_stays_open(tiny_llama_dir: Path) -> None:
    offline = llm(tiny_llama_dir)
    for timeout in BAD_TIMEOUTS:
        with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
            offline.close(timeout)  # type: ignore[arg-type]
    assert offline.generate([5, 6, 7], SamplingParams(max_tokens=1))[0].finish_reason == "length"  # still open
    offline.close()
