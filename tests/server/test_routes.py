"""In-process tests of every route and error (httpx over ASGI), on a real engine."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from runtime.lora.adapter import WEIGHTS_FILE
from runtime.server.app import create_app
from runtime.server.options import ADAPTER_NAME_RULE, ServerOptions
from runtime.server.serve_config import parse_lora_module
from tests.server.conftest import client_for

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def app(engine, adapter_root: Path):
    return create_app(engine, ServerOptions(enable_adapter_admin=True, adapter_roots=(adapter_root,)))


def greedy(model: str, prompt, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}


async def test_health_and_models(app, engine) -> None:
    async with client_for(app) as c:
        assert (await c.get("/health")).json() == {"status": "ok"}
        data = (await c.get("/v1/models")).json()["data"]
    base = engine.model_name
    assert data[0]["id"] == base and data[0]["parent"] is None
    adapters = {m["id"]: m for m in data[1:]}
    assert set(adapters) == {a.name for a in engine.adapters()} and len(adapters) == 3
    assert all(m["parent"] == base for m in adapters.values())


async def test_completion_shapes(app, engine) -> None:
    name = engine.adapters()[0].name
    async with client_for(app) as c:
        one = (await c.post("/v1/completions", json=greedy(name, "hello", return_token_ids=True))).json()
        many = (await c.post("/v1/completions", json=greedy(name, ["hello", "other words"]))).json()
        ids = (await c.post("/v1/completions", json=greedy(name, one["choices"][0]["prompt_token_ids"]))).json()
    choice = one["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert len(choice["token_ids"]) == one["usage"]["completion_tokens"] <= 6
    assert one["usage"]["total_tokens"] == one["usage"]["prompt_tokens"] + one["usage"]["completion_tokens"]
    assert [c["index"] for c in many["choices"]] == [0, 1]
    assert many["choices"][0]["text"] == choice["text"]  # same prompt, greedy
    assert ids["choices"][0]["text"] == choice["text"]  # token-id prompt == its text prompt


async def test_stream_matches_whole(app, engine) -> None:
    name = engine.adapters()[1].name
    async with client_for(app) as c:
        whole = (await c.post("/v1/completions", json=greedy(name, "stream me"))).json()["choices"][0]["text"]
        async with c.stream("POST", "/v1/completions", json=greedy(name, "stream me", stream=True, stream_options={"include_usage": True})) as r:
            lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    assert text == whole
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
    assert any(ch["choices"] and ch["choices"][0]["finish_reason"] for ch in chunks)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_gives_a_chunk_per_token(app, engine, path) -> None:
    """stream_options.continuous_usage_stats: every step's token gets a chunk with the running usage,
    text or not (benchmarks time TTFT/TPOT on it); without include_usage it is a 400."""
    name = engine.adapters()[0].name
    body = {"model": name, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "stream": True}
    body.update({"messages": [{"role": "user", "content": "count"}]} if "chat" in path else {"prompt": "count with me"})
    async with client_for(app) as c:
        async with c.stream("POST", path, json={**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
            lines = [line async for line in r.aiter_lines() if line]
        bad = await c.post(path, json={**body, "stream_options": {"continuous_usage_stats": True}})
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    counts = [ch["usage"]["completion_tokens"] for ch in chunks if ch["choices"] and "usage" in ch]
    if "chat" in path:  # the role chunk comes first, with the prompt's usage (vLLM)
        assert chunks[0]["choices"][0]["delta"].get("role") == "assistant" and counts[0] == 0
        assert chunks[0]["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] > 0
        counts = counts[1:]
    assert all("usage" in ch for ch in chunks)  # every chunk, as documented
    assert counts == list(range(1, 8))  # one chunk per generated token, one token per decode step
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
    assert bad.status_code == 400 and "include_usage" in bad.text


async def test_chat_whole_and_stream(app, engine) -> None:
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5, "temperature": 0}
    async with client_for(app) as c:
        whole = (await c.post("/v1/chat/completions", json=body)).json()
        async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            lines = [line async for line in r.aiter_lines() if line]
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    assert lines[-1] == "data: [DONE]"
    deltas = [json.loads(l[6:])["choices"][0]["delta"] for l in lines[:-1]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == whole["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "patch, status, fragment",
    [
        ({"model": "no-such-adapter"}, 404, "does not exist"),
        ({"temperature": -1}, 400, "temperature"),
        ({"n": 0}, 400, "n"),
        ({"n": 65}, 400, "n"),
        ({"logprobs": 21}, 400, "logprobs"),
        ({"suffix": "x"}, 400, "suffix"),
        ({"surprise": True}, 400, "surprise"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x" * 400}, 400, ""),
        ({"prompt": [999999]}, 400, "token ids"),
        ({"prompt": []}, 400, "empty"),
    ],
)
async def test_errors_are_openai_shaped(app, engine, patch, status, fragment) -> None:
    async with client_for(app) as c:
        r = await c.post("/v1/completions", json={**greedy(engine.model_name, "hi"), **patch})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert fragment in err["message"] and err["type"]
        # The server keeps serving everyone else.
        ok = await c.post("/v1/completions", json=greedy(engine.model_name, "still fine"))
        assert ok.status_code == 200


async def test_admin_disabled_by_default(engine) -> None:
    async with client_for(create_app(engine, ServerOptions())) as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert r.status_code == 404


async def test_api_key_on_every_route_but_health(engine) -> None:
    app = create_app(engine, ServerOptions(api_key="s3cret-key"))
    async with client_for(app) as c:
        assert (await c.get("/health")).status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/openapi.json"), ("POST", "/v1/completions")):
            r = await c.request(method, path, json=greedy(engine.model_name, "hi"))
            assert r.status_code == 401, path
            assert "API key" in r.json()["error"]["message"]
        r = await c.get("/v1/models", headers={"Authorization": "Bearer s3cret-key"})
        assert r.status_code == 200
        r = await c.get("/v1/models", headers={"Authorization": "Bearer wrong-key"})
        assert r.status_code == 401


async def test_body_size_limit(engine) -> None:
    app = create_app(engine, ServerOptions(max_request_bytes=2048))
    async with client_for(app) as c:
        r = await c.post("/v1/completions", json=greedy(engine.model_name, "y" * 5000))
    assert r.status_code == 413


async def test_path_escapes_refused(app, adapter_root: Path, tiny_adapters, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    link = adapter_root / "sneaky"
    if not link.exists():
        os.symlink(next(iter(tiny_adapters.values())), link)  # points outside the root
    attempts = [str(adapter_root / ".." / "x"), str(outside), str(link), "relative/path", "/etc"]
    async with client_for(app) as c:
        for path in attempts:
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": path})
            assert r.status_code == 403, (path, r.text)
        names = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
    assert "evil" not in names


async def test_a_file_swapped_out_of_the_root_after_the_check_is_refused(app, adapter_root: Path, tiny_adapters, tmp_path: Path,
                                                                         monkeypatch) -> None:
    """The route confines the path, then the loader reads it: a weights file swapped for a symlink
    to one outside the root in between used to be loaded (200, the outside weights served); the
    loader now confines the paths it opens itself, so it is a 403 and nothing is registered."""
    import runtime.server.admin as admin_module

    folder = adapter_root / "swapped"
    if not folder.exists():
        shutil.copytree(next(iter(tiny_adapters.values())), folder)
    outside = shutil.copytree(folder, tmp_path / "outside-copy")
    confine = admin_module.confine_adapter_folder

    def confine_then_swap(*args):
        path = confine(*args)
        (folder / WEIGHTS_FILE).unlink()
        (folder / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)
        return path

    monkeypatch.setattr(admin_module, "confine_adapter_folder", confine_then_swap)
    async with client_for(app) as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "swapped", "lora_path": str(folder)})
        names = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "path_not_allowed" and WEIGHTS_FILE in err["message"] and "nothing of it was read" in err["message"], err
    assert str(outside) not in err["message"] and "swapped" not in names


async def test_bad_adapter_gets_validator_message(app, adapter_root: Path, tiny_adapters) -> None:
    bad = adapter_root / "broken"
    if not bad.exists():
        shutil.copytree(next(iter(tiny_adapters.values())), bad)
    (bad / "adapter_config.json").write_text("{not json")
    async with client_for(app) as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(bad)})
    assert r.status_code == 400
    assert "adapter_config.json" in r.json()["error"]["message"]


async def test_adapter_path_naming_a_file_is_named_as_such(app, adapter_root: Path, tiny_adapters) -> None:
    """A lora_path that names a file (say the folder's adapter_config.json) gets the loader's
    message for it, not an error about a path under it that the caller never sent."""
    folder = adapter_root / "as-file"
    if not folder.exists():
        shutil.copytree(next(iter(tiny_adapters.values())), folder)
    config = folder / "adapter_config.json"
    async with client_for(app) as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "as-file", "lora_path": str(config)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_adapter" and err["param"] == "lora_path", err
    assert "is a file" in err["message"] and "adapter_config.json/" not in err["message"], err


async def test_metrics_have_adapter_labels(app, engine) -> None:
    name = engine.adapters()[2].name
    async with client_for(app) as c:
        await c.post("/v1/completions", json=greedy(name, "count me"))
        text = (await c.get("/metrics")).text
    assert f'lorafleet_requests_total{{adapter="{name}"' in text
    assert f'lorafleet_time_to_first_token_seconds_count{{adapter="{name}"}}' in text
    for gauge in ("lorafleet_kv_blocks_free", "lorafleet_kv_blocks", "lorafleet_requests_running", "lorafleet_adapter_pool_bytes_in_use"):
        assert f"# TYPE {gauge} gauge" in text
    # Prometheus keeps the _total suffix for counters: a gauge named so reads as one to rate() and to promtool
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
    assert not [name for name, kind in types.items() if kind != "counter" and name.endswith("_total")], types
    base = engine.model_name
    async with client_for(app) as c:
        await c.post("/v1/completions", json=greedy(base, "the base model too"))
        text = (await c.get("/metrics")).text
    assert 'lorafleet_requests_total{adapter="__base__"' in text
    assert 'adapter="__base__"' not in "".join(line for line in text.splitlines(True) if line.startswith("lorafleet_adapter_"))  # no pool series
    for reserved in ("__base__", "__other__"):  # the labels could not tell the base model, or the adapters past the cap, from it
        with pytest.raises(ValueError, match=f"'{reserved}' is reserved"):
            engine.register_adapter(reserved, str(engine.adapters()[0].path))


async def test_openapi_describes_request_bodies(app) -> None:
    async with client_for(app) as c:
        schema = (await c.get("/openapi.json")).json()
    comps = schema["components"]["schemas"]
    assert {"prompt", "model", "max_tokens", "stream", "return_token_ids"} <= set(comps["CompletionRequest"]["properties"])
    assert "messages" in comps["ChatCompletionRequest"]["properties"]
    assert "/v1/load_lora_adapter" in schema["paths"]


async def test_benchmark_http_replay_times_every_token(app, engine) -> None:
    """runtime.bench.replay.replay_http against the real app: every request gets exactly its
    output length, TTFT/TPOT come from token counts, and pool counters are not invented."""
    from runtime.bench.replay import replay_http
    from runtime.bench.summary import summarize
    from runtime.bench.workload import WorkloadRequest

    names = [a.name for a in engine.adapters()]
    reqs = [WorkloadRequest(i, 0.0, names[i % len(names)] if i % 4 else None, 8, "tell me a story", 4, out)
            for i, out in enumerate([1, 2, 5, 7, 3, 6])]  # fmt: skip
    result = await replay_http("http://test", engine.model_name, reqs, "http", transport=httpx.ASGITransport(app=app))
    assert [r.error for r in result.records] == [None] * 6
    assert [r.output_tokens for r in result.records] == [1, 2, 5, 7, 3, 6]
    assert all(r.prompt_tokens > 0 and r.ttft is not None and r.ttft >= 0 for r in result.records)
    assert result.records[0].tpot is None and all(r.tpot is not None and r.tpot >= 0 for r in result.records[1:])
    summary = summarize(result, 2.0, 0.5)
    assert summary["output_tokens"] == 24 and summary["adapter_swaps"] is None and summary["cache"]["device_hits"] is None


async def test_adapter_file_removed_during_load_is_a_400(app, adapter_root: Path, tiny_adapters, monkeypatch) -> None:
    """A file that goes away between the loader's existence checks and its read is a clear 400, not a 500."""
    import runtime.lora.adapter as adapter_module

    folder = adapter_root / "vanishing"
    if not folder.exists():
        shutil.copytree(next(iter(tiny_adapters.values())), folder)
    read_config = adapter_module._read_config

    def read_config_then_lose_weights(path: Path, *resolved: str) -> dict:
        (path.parent / adapter_module.WEIGHTS_FILE).unlink()  # removed after is_file(), before read_bytes()
        return read_config(path, *resolved)

    monkeypatch.setattr(adapter_module, "_read_config", read_config_then_lose_weights)
    async with client_for(app) as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "vanishing", "lora_path": str(folder)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_path" and "cannot read" in err["message"] and adapter_module.WEIGHTS_FILE in err["message"]


def body_for(path: str, model: str, **extra) -> dict:
    """A small greedy request for ``path`` (completions or chat), with ``extra`` fields."""
    what = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    return {"model": model, "max_tokens": 3, "temperature": 0, **what, **extra}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_options_need_stream(app, engine, path) -> None:
    """stream_options without stream: true is a 400 (as OpenAI and vLLM), not silently ignored."""
    async with client_for(app) as c:
        for stream in ({}, {"stream": False}):
            r = await c.post(path, json=body_for(path, engine.model_name, stream_options={"include_usage": True}, **stream))
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "stream_options" and "only allowed when stream is true" in err["message"]
        assert (await c.post(path, json=body_for(path, engine.model_name, stream_options=None))).status_code == 200  # null is no option


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "patch, param",
    [({"max_tokens": True}, "max_tokens"), ({"seed": True}, "seed"), ({"top_k": True}, "top_k"), ({"n": True}, "n"),
     ({"stop_token_ids": [True]}, "stop_token_ids.0"), ({"temperature": True}, "temperature"), ({"top_p": True}, "top_p"),
     ({"presence_penalty": False}, "presence_penalty"), ({"max_tokens": 2.0}, "max_tokens")],
)  # fmt: skip
async def test_booleans_are_not_numbers(app, engine, path, patch, param) -> None:
    """JSON true is not 1 (pydantic's lax mode would coerce it): integer and number fields refuse booleans."""
    async with client_for(app) as c:
        r = await c.post(path, json=body_for(path, engine.model_name, **patch))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("prompt", [[True], [1, True], [[5, 6], [True]], [1.0], ["text", 3]])
async def test_prompt_token_ids_must_be_integers(app, engine, prompt) -> None:
    async with client_for(app) as c:
        r = await c.post("/v1/completions", json=greedy(engine.model_name, prompt))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "token ids (integers)" in err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_float_fields_take_integers(app, engine, path) -> None:
    """JSON 1 and 0 are normal numbers for temperature and top_p: accepted, and the same as 1.0 and 0.0."""
    async with client_for(app) as c:
        ints = await c.post(path, json=body_for(path, engine.model_name, temperature=1, top_p=1, seed=7))
        floats = await c.post(path, json=body_for(path, engine.model_name, temperature=1.0, top_p=1.0, seed=7))
        greedy_int = await c.post(path, json=body_for(path, engine.model_name, temperature=0))
    assert ints.status_code == floats.status_code == greedy_int.status_code == 200, (ints.text, floats.text, greedy_int.text)
    assert ints.json()["choices"] == floats.json()["choices"]


async def post_raw(c: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    """POST ``body`` as ASCII JSON, so a lone surrogate travels as the escape ``\\ud800`` (what a
    client's JSON encoder sends), which httpx's own UTF-8 encoding of ``json=`` cannot carry."""
    return await c.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    "path, patch, param",
    [("/v1/completions", {"prompt": "a\ud800b"}, "prompt"), ("/v1/completions", {"prompt": ["ok", "\udc00"]}, "prompt.1"),
     ("/v1/completions", {"stop": ["\ud800"]}, "stop.0"), ("/v1/completions", {"user": "bob\ud800"}, "user"),
     ("/v1/completions", {"model": "x\ud800"}, "model"),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages.0.content.0.text"),
     ("/tokenize", {"prompt": "\ud800"}, "prompt"),
     ("/tokenize", {"prompt": None, "messages": [{"role": "user", "content": "a\ud800"}]}, "messages.0.content")],
)  # fmt: skip
async def test_lone_surrogates_are_400s_naming_the_field(app, engine, path, patch, param) -> None:
    """JSON's "\\ud800" is a string but not Unicode text: the tokenizer cannot encode it (it was a 500)."""
    body = {**body_for(path, engine.model_name), **patch} if path != "/tokenize" else {"model": engine.model_name, **patch}
    body = {k: v for k, v in body.items() if v is not None}
    async with client_for(app) as c:
        r = await post_raw(c, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "lone surrogate" in err["message"] and err["code"] == "invalid_parameter", err
        assert (await c.get("/health")).status_code == 200


def test_the_engine_refuses_a_lone_surrogate_as_a_prompt_error(engine) -> None:
    with pytest.raises(ValueError, match="prompt: not valid Unicode text"):
        engine.engine.add_request("surrogate", "x\ud800", None)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("patch, param", [({"stream": "false"}, "stream"), ({"ignore_eos": 1}, "ignore_eos"),
                                          ({"return_token_ids": "yes"}, "return_token_ids")])  # fmt: skip
async def test_booleans_take_true_and_false_only(app, engine, path, patch, param) -> None:
    async with client_for(app) as c:
        r = await c.post(path, json=body_for(path, engine.model_name, **patch))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_a_logit_bias_that_is_not_a_number_names_its_entry(app, engine) -> None:
    async with client_for(app) as c:
        r = await c.post("/v1/completions", json=greedy(engine.model_name, "hi", logit_bias={"5": True}))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logit_bias.5" and "valid number" in err["message"], r.text


@pytest.mark.parametrize(
    "content, headers, fragment",
    [(b'{"model": "m", "prompt": "\xff\xfe"}', {"Content-Type": "application/json"}, "not valid UTF-8 (byte 0xff at position 26)"),
     (b'{"model":"upper","prompt":"\x80\x81"}', {"Content-Type": "application/json"}, "not valid UTF-8 (byte 0x80 at position 27)"),
     (b"\xff\xfe", {"Content-Type": "application/json"}, "not valid UTF-8 (byte 0xff at position 0)"),  # json.loads read it as UTF-16
     (b'{"model": "m", "prompt": "hi"', {"Content-Type": "application/json"}, "not valid JSON (at position"),
     (b'{"model": "m", "prompt": "hi"}', {"Content-Type": "application/x-www-form-urlencoded"}, "Content-Type: application/json"),
     (b"", {}, "must be a JSON object")],
)  # fmt: skip
async def test_bodies_that_are_not_json_say_so(app, content, headers, fragment) -> None:
    async with client_for(app) as c:
        r = await c.post("/v1/completions", content=content, headers=headers)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_json" and fragment in err["message"], r.text


async def test_a_utf8_body_may_start_with_a_byte_order_mark(app, engine) -> None:
    """Bodies are read as UTF-8, never guessed (UTF-16 was); a UTF-8 byte-order mark is still fine."""
    body = b"\xef\xbb\xbf" + json.dumps(greedy(engine.model_name, "h\u00e9llo")).encode()
    async with client_for(app) as c:
        r = await c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        tokenize = await c.post("/tokenize", content=b"\xff\xfe", headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert tokenize.json()["error"]["message"] == "the request body is not valid UTF-8 (byte 0xff at position 0)", tokenize.text


LONG = "u" * 257


@pytest.mark.parametrize(
    "path, patch, param, message",
    [("/v1/completions", {"user": LONG}, "user", "user: at most 256 characters, got 257"),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": LONG}]}, "messages.0.name",
      "messages.0.name: at most 256 characters, got 257"),
     ("/v1/completions", {"stop_token_ids": list(range(257))}, "stop_token_ids", "stop_token_ids: at most 256 items, got 257"),
     ("/v1/chat/completions", {"messages": []}, "messages", "messages: at least 1 item, got 0"),
     ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "top_logprobs: needs logprobs: true"),
     ("/v1/completions", {"stop": ["a"] * 17}, "stop", "stop: at most 16 stop strings"),
     ("/v1/completions", {"prompt": "x\ud800"}, "prompt", "prompt: not valid Unicode text: a lone surrogate '\\ud800' at character 1"),
     ("/v1/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats",
      "stream_options.continuous_usage_stats: needs stream_options.include_usage: true"),
     ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options", "stream_options: only allowed when stream is true"),
     ("/v1/chat/completions", {"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens",
      "max_completion_tokens: 4 differs from max_tokens (3); send one of them"),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0.content",
      "messages.0.content: a user message needs content"),
     ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "a"}, {"role": "system", "content": None}]}, "messages.1.content",
      "messages.1.content: a system message needs content"),
     # OpenAI fields lorafleet lacks say what it lacks (pydantic said "Extra inputs are not permitted"); others are unknown
     ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
      "tools: not supported: lorafleet does not implement tool calling (null is accepted)"),
     ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "a", "tool_calls": []}, {"role": "user", "content": "b"}]},
      "messages.0.tool_calls", "messages.0.tool_calls: not supported: lorafleet does not implement tool calling (null is accepted)"),
     ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format.type",
      "response_format.type: 'json_object' is not supported: lorafleet does not implement JSON mode or structured output; only \"text\""),
     ("/v1/completions", {"suffix": "x"}, "suffix", "suffix: not supported: lorafleet does not implement suffix (text inserted after the completion) "
      "(null is accepted)"),
     ("/v1/completions", {"surprise": True}, "surprise", "surprise: unknown field"),
     ("/v1/completions", {"skip_special_tokens": False}, "skip_special_tokens",
      "skip_special_tokens: false is not supported: lorafleet's text always leaves special tokens out (true, vLLM's default)")],
)  # fmt: skip
async def test_validation_errors_are_in_plain_words(app, engine, path, patch, param, message) -> None:
    """Messages name the field once and say what is wrong in the API's words: no pydantic
    wording ("Value error, ", "items after validation" for a string); a field inside another
    (a message's content) is named with dots, as docs/api.md says."""
    async with client_for(app) as c:
        r = await post_raw(c, path, body_for(path, engine.model_name, **patch))
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_parameter"}


@pytest.mark.parametrize("name", ["_x", "", "a" * 129, "a/b"])
async def test_a_refused_adapter_name_says_the_rule(app, adapter_root: Path, name) -> None:
    """The admin route states the name rule in the words --lora-modules uses (one shared text),
    not as pydantic's regular expression."""
    async with client_for(app) as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter_root / "a")})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "lora_name" and err["code"] == "invalid_parameter", r.text
    assert err["message"] == f"lora_name: must be {ADAPTER_NAME_RULE}" == "lora_name: must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"


async def test_a_configured_adapter_given_by_a_relative_path_has_an_absolute_root(app, adapter_root: Path, engine, monkeypatch) -> None:
    """``--lora-modules relative=a`` (or the config file's lora_modules) shows the absolute folder
    in GET /v1/models, as admin-loaded adapters do, not the string as typed."""
    monkeypatch.chdir(adapter_root)
    module = parse_lora_module("relative=a")
    engine.register_adapter(module.name, module.path)
    try:
        async with client_for(app) as c:
            cards = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
    finally:
        engine.unregister_adapter("relative")
    assert cards["relative"]["root"] == str(adapter_root / "a")


async def test_paths_outside_the_root_are_403s_whatever_is_there(app, adapter_root: Path, tmp_path_factory) -> None:
    """A path outside every root got a 400 "Not a directory" under a file (/etc/passwd/x) or a 400
    "Symlink loop" through a loop, against a 403 elsewhere: the answer told what exists outside."""
    outside = tmp_path_factory.mktemp("outside")
    (outside / "a-file").write_text("secret")
    os.symlink(outside / "loop", outside / "loop")
    async with client_for(app) as c:
        for path in (outside / "a-file" / "x", outside / "loop" / "x", outside / "nothing" / "x"):
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "probe", "lora_path": str(path)})
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["message"] == f"lora_path {str(path)!r} resolves outside every --adapter-root", r.text


async def test_unusable_adapter_paths_are_400s(app, adapter_root: Path, engine) -> None:
    loop = adapter_root / "loop"
    if not loop.is_symlink():
        os.symlink(loop, loop)  # points at itself
    async with client_for(app) as c:
        for path in (str(adapter_root / "a\x00b"), str(loop / "x")):
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "bad-path", "lora_path": path})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["param"] == "lora_path" and "not a usable path" in err["message"], err
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": engine.model_name, "lora_path": str(adapter_root)})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_parameter", r.text
    loop.unlink()


async def test_client_strings_cannot_forge_log_lines(app, engine, caplog) -> None:
    caplog.set_level("INFO", logger="lorafleet.requests")
    async with client_for(app) as c:
        r = await c.post("/v1/completions", json=greedy(engine.model_name, "hi", user="carol\nINFO: forged line"))
    assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if "user=" in rec.getMessage()]
    assert lines and all("\n" not in line for line in lines) and any("'carol\\nINFO: forged line'" in line for line in lines)


async def test_an_adapter_card_is_dated_by_its_registration(app, adapter_root: Path, engine, monkeypatch) -> None:
    import runtime.lora.registry as registry_module

    monkeypatch.setattr(registry_module.time, "time", lambda: 1_000_000_000.7)  # long before this server started
    async with client_for(app) as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "dated", "lora_path": str(adapter_root / "a")})
        assert r.status_code == 200, r.text
        cards = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
        await c.post("/v1/unload_lora_adapter", json={"lora_name": "dated"})
    assert cards["dated"]["created"] == 1_000_000_000
    assert cards[engine.model_name]["created"] > 1_000_000_000  # the base: the server's start


async def test_admin_routes_on_a_stopped_engine_are_503s(adapter_root: Path, tiny_llama_dir: Path) -> None:
    """Once the engine is shut down (or has died), a load or unload is a 503 engine_unavailable,
    as completions are, not a 500 "internal server error" with a traceback in the log."""
    from runtime.async_engine import AsyncLLMEngine
    from tests.server.conftest import make_engine_config

    stopped = AsyncLLMEngine(make_engine_config(tiny_llama_dir))
    app = create_app(stopped, ServerOptions(enable_adapter_admin=True, adapter_roots=(adapter_root,)))
    stopped.shutdown()
    async with client_for(app, raise_app_exceptions=False) as c:
        load = await c.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapter_root / "a")})
        unload = await c.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    for r in (load, unload):
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unavailable", r.text
