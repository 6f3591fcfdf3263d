"""The security review's claims, each shown against a real app (see docs/security.md).

Admin off by default; the API key on every route but /health (wrong keys of the right
length too); adapter paths confined with symlinks resolved, also for the files inside
the folder; body limits on declared and chunked bodies; bounded stop lists and prompts;
pickled adapter weights refused without being unpickled.
"""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from runtime.async_engine import AsyncLLMEngine
from runtime.lora.adapter import WEIGHTS_FILE
from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.faults.conftest import engine_config
from tests.server_harness import running_server

KEY = "k" * 40


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, tiny_adapters: dict[str, Path]):
    eng = AsyncLLMEngine(engine_config(tiny_llama_dir, max_model_len=64))
    eng.register_adapter("a", str(tiny_adapters["a"]))
    yield eng
    eng.shutdown()


def routes(app) -> list[tuple[str, str]]:
    """Every documented operation, plus the schema and docs pages themselves."""
    documented = [(method.upper(), path) for path, ops in app.openapi()["paths"].items() for method in ops]
    return documented + [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/docs/oauth2-redirect")]


def test_admin_routes_are_off_by_default(engine) -> None:
    """Off, they are a 404 that says how to turn them on (it was a bare "Not Found"), load nothing
    and are not in the schema."""
    app = create_app(engine)
    assert not any("lora_adapter" in path for path in app.openapi()["paths"])
    with TestClient(app) as client:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = client.post(path, json={"lora_name": "a", "lora_path": "/tmp"})
            assert r.status_code == 404
            error = r.json()["error"]
            assert error["code"] == "not_found" and error["type"] == "not_found_error"
            assert error["message"].startswith(f"{path}: adapter admin is off on this server; start `lorafleet serve` with --enable-adapter-admin")
        assert [a.name for a in engine.adapters()] == ["a"]  # neither reloaded nor unloaded


def test_api_key_on_every_route_but_health(engine, tmp_path: Path) -> None:
    app = create_app(engine, ServerOptions(api_key=KEY, enable_adapter_admin=True, adapter_roots=(tmp_path,)))
    found = routes(app)
    assert ("POST", "/v1/load_lora_adapter") in found and ("GET", "/openapi.json") in found
    with TestClient(app) as client:
        for method, path in found:
            for headers in ({}, {"Authorization": "Bearer " + "x" * len(KEY)}, {"Authorization": KEY}, {"Authorization": f"bearer {KEY}"}):
                r = client.request(method, path, headers=headers)
                if path == "/health":
                    assert r.status_code == 200
                else:
                    assert r.status_code == 401, (method, path, headers)
                    assert r.json()["error"]["type"] == "authentication_error"
            r = client.request(method, path, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code != 401, (method, path)


def test_adapter_files_symlinked_out_of_the_root_are_refused(engine, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    shutil.copytree(tiny_adapters["b"], outside)
    inside = root / "looks-inside"
    inside.mkdir()
    shutil.copy(outside / "adapter_config.json", inside / "adapter_config.json")
    os.symlink(outside / WEIGHTS_FILE, inside / WEIGHTS_FILE)  # the weights file escapes the root
    app = create_app(engine, ServerOptions(enable_adapter_admin=True, adapter_roots=(root,)))
    before = [a.name for a in engine.adapters()]
    with TestClient(app) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "sneaky", "lora_path": str(inside)})
        assert r.status_code == 403 and WEIGHTS_FILE in r.json()["error"]["message"]
        # The folder itself through a symlink and a relative escape: refused too.
        os.symlink(outside, root / "link")
        for path in (str(root / "link"), str(root / ".." / "outside"), "relative/path"):
            assert client.post("/v1/load_lora_adapter", json={"lora_name": "sneaky", "lora_path": path}).status_code == 403
    assert [a.name for a in engine.adapters()] == before


class _Canary:
    """Unpickling this touches a file: proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_adapter_is_refused_and_never_unpickled(engine, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    root = tmp_path / "root"
    folder = root / "pickled"
    folder.mkdir(parents=True)
    shutil.copy(tiny_adapters["a"] / "adapter_config.json", folder / "adapter_config.json")
    marker = tmp_path / "UNPICKLED"
    (folder / "adapter_model.bin").write_bytes(pickle.dumps(_Canary(marker)))
    with TestClient(create_app(engine, ServerOptions(enable_adapter_admin=True, adapter_roots=(root,)))) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "pickled", "lora_path": str(folder)})
    assert r.status_code == 400 and "never unpickled" in r.json()["error"]["message"]
    assert not marker.exists()


def test_body_limits_declared_and_chunked(engine) -> None:
    app = create_app(engine, ServerOptions(max_request_bytes=4096))
    body = b'{"model": "a", "prompt": "' + b"x" * 8000 + b'"}'
    with running_server(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413
        chunked = client.post("/v1/completions", content=iter([body[i : i + 1000] for i in range(0, len(body), 1000)]),
                              headers={"content-type": "application/json"})
        assert chunked.status_code == 413
        assert client.post("/v1/completions", json={"model": "a", "prompt": "fine", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("extra, param", [
    ({"prompt": "y" * 500}, "prompt"),  # more tokens than max_model_len
    ({"prompt": "ok", "max_tokens": 10_000}, "max_tokens"),  # the engine words it as a max_tokens error
    ({"prompt": "ok", "stop_token_ids": list(range(257))}, "stop_token_ids"),
    ({"prompt": "ok", "stop": "s" * 1025}, "stop"),
    ({"prompt": "ok", "stop": ["s"] * 17}, "stop"),
    ({"prompt": [10**9]}, None),  # token id outside the vocabulary
])
def test_bounded_prompts_and_stop_lists(engine, extra: dict, param: str | None) -> None:
    with TestClient(create_app(engine)) as client:
        r = client.post("/v1/completions", json={"model": "a", **extra})
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_loading_by_path_needs_an_adapter_root(engine, tiny_adapters: dict[str, Path]) -> None:
    with TestClient(create_app(engine, ServerOptions(enable_adapter_admin=True))) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tiny_adapters["a"])})
    assert r.status_code == 403 and "--adapter-root" in r.json()["error"]["message"]


HOSTILE_TEMPLATE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
STRICT_TEMPLATE = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages') }}{% endif %}{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("template, text", [(HOSTILE_TEMPLATE, "cannot render"), (STRICT_TEMPLATE, "no system messages")])
def test_chat_template_runs_sandboxed_and_its_refusals_are_400(template: str, text: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A checkpoint's template cannot reach Python internals, and a template that refuses
    the caller's messages (``raise_exception``) is the caller's 400, not a server error."""
    import json

    model = Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    eng = AsyncLLMEngine(engine_config(model, max_model_len=64))
    try:
        with TestClient(create_app(eng)) as client:
            r = client.post("/v1/chat/completions", json={"model": eng.model_name, "max_tokens": 2,
                                                          "messages": [{"role": "system", "content": "hi"}]})
        assert r.status_code == 400, r.text
        assert text in r.json()["error"]["message"] and r.json()["error"]["param"] == "messages"
    finally:
        eng.shutdown()
