"""Against a real uvicorn server on 127.0.0.1: the openai client, concurrency, admin flow, disconnects."""
from __future__ import annotations

import concurrent.futures as cf
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from runtime.request import SamplingParams
from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server_harness import running_server, wait_until


@pytest.fixture(scope="module")
def live(engine, adapter_root: Path):
    app = create_app(engine, ServerOptions(enable_adapter_admin=True, adapter_roots=(adapter_root,)))
    with running_server(app) as url:
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def idle(engine) -> bool:
    snap = engine.snapshot()
    refs = snap["total_refcounts"]
    return (snap["running"] == 0 and snap["waiting"] == 0 and snap["kv_blocks_free"] == snap["kv_blocks_total"]
            and refs["adapter_demand"] == 0 and refs["adapter_device_refs"] == 0)


def offline(engine, prompt: str, adapter: str | None, max_tokens: int) -> str:
    """The same engine, driven directly (no HTTP): the reference for each response."""
    import asyncio

    async def run() -> str:
        last = None
        async for out in engine.generate(f"ref-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), adapter):
            last = out
        return last.text

    return asyncio.run(run())


def test_openai_client_completion_chat_stream(live, engine) -> None:
    c = client(live)
    name = engine.adapters()[0].name
    comp = c.completions.create(model=name, prompt="hello there", max_tokens=6, temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.usage.completion_tokens >= 1
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model=name, prompt="hello there", max_tokens=6, temperature=0, stream=True) if ch.choices)
    assert streamed == comp.choices[0].text
    chat = c.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "hey"}], max_tokens=5, temperature=0)
    chat_stream = c.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "hey"}], max_tokens=5, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chat_stream if ch.choices) == chat.choices[0].message.content
    models = {m.id: m for m in c.models.list().data}
    assert engine.model_name in models
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="missing", prompt="x", max_tokens=2)


def test_openai_client_parses_logprobs_and_takes_penalties(live, engine) -> None:
    c = client(live)
    name = engine.adapters()[0].name
    comp = c.completions.create(model=name, prompt="hello there", max_tokens=5, temperature=0, logprobs=2, presence_penalty=0.5,
                                frequency_penalty=0.5, extra_body={"ignore_eos": True, "repetition_penalty": 1.2})  # fmt: skip
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens == 5
    assert "".join(lp.tokens) == comp.choices[0].text
    chat = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hey"}], max_tokens=4, temperature=0,
                                     logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    assert bytes(b for t in content for b in t.bytes).decode(errors="replace") == chat.choices[0].message.content
    several = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hey"}], max_tokens=4, n=3, seed=5)
    assert [ch.index for ch in several.choices] == [0, 1, 2]
    assert several.usage.prompt_tokens == chat.usage.prompt_tokens  # the shared prompt counts once


def test_concurrent_mixed_adapters_match_offline(live, engine) -> None:
    names = [a.name for a in engine.adapters()] + [None]
    prompts = [f"prompt number {i} says" for i in range(12)]
    jobs = [(p, names[i % len(names)]) for i, p in enumerate(prompts)]
    c = client(live)

    def call(job):
        prompt, adapter = job
        r = c.completions.create(model=adapter or engine.model_name, prompt=prompt, max_tokens=8, temperature=0)
        return r.choices[0].text

    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(call, jobs))
    want = [offline(engine, p, a, 8) for p, a in jobs]
    assert got == want
    assert wait_until(lambda: idle(engine))


def test_admin_load_hot_update_inflight_unload(live, engine, adapter_root: Path, tiny_adapters) -> None:
    c = client(live)
    first, second = sorted(tiny_adapters)[0], sorted(tiny_adapters)[1]
    path_v1 = adapter_root / "hot_v1"
    path_v2 = adapter_root / "hot_v2"
    for src, dst in ((first, path_v1), (second, path_v2)):
        if not dst.exists():
            shutil.copytree(tiny_adapters[src], dst)
    with httpx.Client(base_url=live, timeout=60) as h:
        v1 = h.post("/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": str(path_v1)}).json()
        ref_v1 = c.completions.create(model="hot", prompt="abc", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
        # Start a long streaming request on v1, then hot-update while it runs.
        stream = c.completions.create(model="hot", prompt="abc", max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        head = next(it).choices[0].text
        v2 = h.post("/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": str(path_v2)}).json()
        assert v2["version"] != v1["version"]
        tail = "".join(ch.choices[0].text for ch in it if ch.choices)
        assert head + tail == ref_v1  # the in-flight request finished on the old version
        ref_v2 = c.completions.create(model="hot", prompt="abc", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
        assert ref_v2 != ref_v1
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "hot"}).status_code == 200
        assert h.post("/v1/completions", json={"model": "hot", "prompt": "abc", "max_tokens": 2}).status_code == 404
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "hot"}).status_code == 404
    assert wait_until(lambda: idle(engine))


@pytest.fixture
def slow_aborts(engine):
    """Steps slowed to 20 ms each, so an 80-token request outlives the client's disconnect, and the
    RequestMetrics of every request that finishes meanwhile (the test's own, as nothing else runs)."""
    runner = engine.engine.runner
    real_execute = runner.execute

    def slow_execute(steps):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        return real_execute(steps)

    finished: list = []
    engine.add_observer(finished.append)
    runner.execute = slow_execute
    try:
        yield finished
    finally:
        runner.execute = real_execute


def assert_one_abort(finished: list, max_tokens: int) -> None:
    """The disconnected request finished as an abort, before its last token."""
    assert wait_until(lambda: finished)
    assert [m.finish_reason for m in finished] == ["abort"], finished
    assert finished[0].output_tokens < max_tokens


def test_stream_disconnect_frees_everything(live, engine, slow_aborts) -> None:
    name = engine.adapters()[1].name
    body = {"model": name, "prompt": "disconnect me", "max_tokens": 80, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(l for l in lines if l).startswith("data: ")
        # leaving the block closes the connection mid-stream
    assert wait_until(lambda: idle(engine), timeout_s=15), engine.snapshot()
    assert_one_abort(slow_aborts, 80)


def test_nonstream_disconnect_aborts(live, engine, slow_aborts) -> None:
    body = {"model": engine.model_name, "prompt": "slow one", "max_tokens": 80, "temperature": 0, "ignore_eos": True}
    done = threading.Event()

    def fire() -> None:
        try:
            httpx.post(f"{live}/v1/completions", json=body, timeout=0.3)
        except httpx.TimeoutException:
            pass
        done.set()

    threading.Thread(target=fire).start()
    assert done.wait(10)
    assert wait_until(lambda: idle(engine), timeout_s=15), engine.snapshot()
    assert_one_abort(slow_aborts, 80)
