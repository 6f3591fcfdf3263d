"""The bundled demo through the real HTTP server: concurrent mixed requests, each routed to its adapter."""
from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from runtime.commands import serve
from runtime.demo import TASKS, expected_continuation, held_out_texts, make_prompt
from runtime.server.app import create_app
from tests.faults.conftest import idle_problems
from tests.server_harness import running_server, wait_until

N_PER_TASK = 10


@pytest.fixture(scope="module")
def demo_server():
    import argparse

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    settings = serve.load_settings(parser.parse_args(["--device", "cpu"]))  # no --model: the bundled demo
    assert settings.uses_demo and settings.server.served_model_name == serve.DEMO_MODEL_NAME
    engine = serve.build_engine(settings)
    try:
        with running_server(create_app(engine, settings.server)) as url:
            yield url, engine
    finally:
        engine.shutdown()


def test_demo_models_listed(demo_server) -> None:
    url, _ = demo_server
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert ids[0] == serve.DEMO_MODEL_NAME and set(ids[1:]) == set(TASKS) - {"base"}


def test_concurrent_mixed_demo_requests_route_to_their_adapter(demo_server) -> None:
    url, engine = demo_server
    texts = held_out_texts(N_PER_TASK, seed=4242, min_len=5, max_len=14)
    jobs = [(task, text) for text in texts for task in TASKS]  # interleaved: [base, upper, reverse, rot13, base, ...]

    def call(job: tuple[str, str]) -> bool:
        task, text = job
        model = serve.DEMO_MODEL_NAME if task == "base" else task
        body = {"model": model, "prompt": make_prompt(text), "max_tokens": len(text) + 3, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        return r.json()["choices"][0]["text"] == expected_continuation(task, text)

    with cf.ThreadPoolExecutor(16) as pool:
        ok = list(pool.map(call, jobs))
    for task in TASKS:
        hits = [o for (t, _), o in zip(jobs, ok) if t == task]
        assert sum(hits) / len(hits) >= 0.9, (task, sum(hits), len(hits))
    # Every request finished: nothing may stay held (KV blocks, adapter refs, loads).
    assert wait_until(lambda: idle_problems(engine.snapshot(), registered=len(TASKS) - 1) == []), idle_problems(engine.snapshot())


def test_demo_chat_uses_the_demo_prompt_format(demo_server) -> None:
    """The demo's chat template turns the last user message into "<text> =>", so chat
    completions give what completions give (the default template's role markers are unknown
    characters to the demo's tokenizer)."""
    url, _ = demo_server
    for task in TASKS:
        model = serve.DEMO_MODEL_NAME if task == "base" else task
        messages = [{"role": "system", "content": "ignored by the demo"}, {"role": "user", "content": "hello world"}]
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected_continuation(task, "hello world"), (task, r.text)
    last_not_user = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": serve.DEMO_MODEL_NAME, "messages": last_not_user}, timeout=120)
    assert r.status_code == 400 and "must be a user message" in r.json()["error"]["message"], r.text
