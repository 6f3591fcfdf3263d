"""Completions with a list of prompts: all admitted at once and awaited together, a client that
goes away during admission aborts them all, and the number of prompts is capped."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator

import httpx
import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from runtime.server.protocol import MAX_PROMPTS
from tests.server_harness import running_server, wait_until

ADMISSION_WAIT_S = 3.0


class _Proxy:
    """The shared engine, with ``generate`` wrapped by the test."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _AllOrNothing(_Proxy):
    """No prompt gets output until every prompt of the request has been started: prompts admitted
    one after another (each waiting for its first token) would never get past the first."""

    def __init__(self, inner: Any, prompts: int) -> None:
        super().__init__(inner)
        self.prompts = prompts
        self.started = 0
        self.all_started: asyncio.Event | None = None

    async def generate(self, request_id: str, prompt: Any, params: Any, adapter: Any, **admission: Any) -> AsyncIterator[Any]:
        self.all_started = self.all_started or asyncio.Event()
        self.started += 1
        if self.started == self.prompts:
            self.all_started.set()
        try:
            await asyncio.wait_for(self.all_started.wait(), ADMISSION_WAIT_S)
        except asyncio.TimeoutError:
            raise ValueError(f"only {self.started} of {self.prompts} prompts were started") from None
        async for out in self._inner.generate(request_id, prompt, params, adapter, **admission):
            yield out


class _StuckAdmission(_Proxy):
    """Prompt 1 is never admitted; records when it is cancelled, and when prompt 0's stream is closed.
    Its generate takes no admission group, so prompt 0 is admitted (and runs) on its own."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.cancelled, self.closed = threading.Event(), threading.Event()

    async def generate(self, request_id: str, prompt: Any, params: Any, adapter: Any) -> AsyncIterator[Any]:
        if request_id.endswith("-1"):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        try:
            async for out in self._inner.generate(request_id, prompt, params, adapter):
                yield out
        finally:
            self.closed.set()


def body(engine: Any, prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"model": engine.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}


@pytest.mark.parametrize("stream", [False, True])
def test_prompts_are_admitted_together(engine, stream: bool) -> None:
    prompts = ["one", "two words", "and three words"]
    app = create_app(_AllOrNothing(engine, len(prompts)), ServerOptions())
    with running_server(app) as url:
        r = httpx.post(f"{url}/v1/completions", json=body(engine, prompts, stream=stream), timeout=30)
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]") and "error" not in r.text
    else:
        assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]


def aborted(url: str) -> float:
    """Requests this app saw finish with finish_reason "abort" (its /metrics)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith('lorafleet_requests_total{adapter="__base__",finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def finished_requests(url: str) -> float:
    """Requests this app saw finish, for any reason (its /metrics)."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("lorafleet_requests_total{"))


@pytest.mark.parametrize("prompts", [[[5, 6], [999999], [7, 8]], ["fine", "x" * 400, "also fine"]])
def test_one_refused_prompt_keeps_every_prompt_from_running(engine, prompts) -> None:
    """One prompt the engine refuses (a bad token id; too long): a 400 naming it, and none of the
    request's prompts runs (docs/api.md): they are checked as a group before any is admitted, so
    none is computed, aborted or counted."""
    app = create_app(engine, ServerOptions())
    with running_server(app) as url:
        r = httpx.post(f"{url}/v1/completions", json=body(engine, prompts, max_tokens=90, ignore_eos=True), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1", r.text
        message = r.json()["error"]["message"]
        assert message.startswith("prompt 1 (of 3): ") and not message.startswith("prompt 1 (of 3): prompt:"), message  # "prompt" once
        assert finished_requests(url) == 0
        ok = httpx.post(f"{url}/v1/completions", json=body(engine, ["a", "b"]), timeout=30)
        assert ok.status_code == 200 and finished_requests(url) == 2


def test_client_gone_during_admission_aborts_every_prompt(engine) -> None:
    proxy = _StuckAdmission(engine)
    app = create_app(proxy, ServerOptions())
    with running_server(app) as url:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", json=body(engine, ["admitted", "never admitted"], max_tokens=80, ignore_eos=True), timeout=0.5)
        assert proxy.cancelled.wait(5), "the stuck admission was not cancelled when the client went away"
        assert proxy.closed.wait(5), "the admitted prompt's stream was not closed (its request not aborted)"


class _NoGroups(_Proxy):
    """Forwards every attribute (admission_group too) but its generate takes no group."""

    async def generate(self, request_id: str, prompt: Any, params: Any, adapter: Any) -> AsyncIterator[Any]:
        async for out in self._inner.generate(request_id, prompt, params, adapter):
            yield out


def test_an_engine_whose_generate_takes_no_group_admits_each_prompt_alone(engine) -> None:
    app = create_app(_NoGroups(engine), ServerOptions())
    with running_server(app) as url:
        r = httpx.post(f"{url}/v1/completions", json=body(engine, ["one", "two"], n=2), timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4


def test_number_of_prompts_is_capped(engine) -> None:
    app = create_app(engine, ServerOptions())
    with running_server(app) as url:
        too_many = httpx.post(f"{url}/v1/completions", json=body(engine, ["x"] * (MAX_PROMPTS + 1)), timeout=30)
        ids_too_many = httpx.post(f"{url}/v1/completions", json=body(engine, [[5]] * (MAX_PROMPTS + 1)), timeout=30)
    for r in (too_many, ids_too_many):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and f"at most {MAX_PROMPTS} prompts" in err["message"]


def test_an_empty_prompt_list_is_worded_as_every_other_field_error(engine) -> None:
    """``"prompt": []`` was "prompt must not be empty", the one field error without the ``prompt:`` prefix."""
    app = create_app(engine, ServerOptions())
    with running_server(app) as url:
        r = httpx.post(f"{url}/v1/completions", json=body(engine, []), timeout=30)
    assert r.status_code == 400 and r.json()["error"] == {"message": "prompt: must not be an empty list", "type": "invalid_request_error",
                                                          "param": "prompt", "code": "invalid_parameter"}


@pytest.mark.parametrize("prompt, param, start", [([[]], "prompt", "prompt: "), ([[5], []], "prompt.1", "prompt 1 (of 2): ")])
def test_an_empty_token_id_prompt_is_named_as_the_engine_names_a_refused_prompt(engine, prompt, param: str, start: str) -> None:
    """An empty token-id list is refused as any other prompt the engine refuses (docs/api.md):
    ``prompt N (of M):`` and ``prompt.N`` among several prompts, plain ``prompt`` for a single one
    (it was ``prompt 0 (of 1)`` / ``prompt.0`` there, unlike a single bad token id)."""
    app = create_app(engine, ServerOptions())
    with running_server(app) as url:
        empty = httpx.post(f"{url}/v1/completions", json=body(engine, prompt), timeout=30)
        bad_id = httpx.post(f"{url}/v1/completions", json=body(engine, [ids or [999999] for ids in prompt]), timeout=30)
    for r in (empty, bad_id):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"].startswith(start), r.text
    assert "must not be empty" in empty.json()["error"]["message"]
