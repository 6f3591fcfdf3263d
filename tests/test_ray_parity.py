"""The Ray application where it answered otherwise than a single server, or started and stopped
less cleanly: a draining replica's refusal, a missing registry actor at start-up, a restarted
registry's entry with other ``--adapter-root`` folders, the registry's own check of a drain, and a
replica's teardown. No Ray cluster: the replica, registry and ingress of ``test_ray_sync``'s
fixtures and helpers, called in process."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from runtime.async_engine import AsyncLLMEngine  # noqa: E402
from runtime.distributed.registry_service import AdapterRegistryService  # noqa: E402
from runtime.distributed.shutdown_timeouts import check_shutdown_timeouts  # noqa: E402
from runtime.request import AdapterRef, SamplingParams  # noqa: E402
from runtime.server.errors import APIError  # noqa: E402
from tests.test_ray_sync import (  # noqa: E402,F401 - fixtures and helpers shared with the sync tests
    RestartsAfter,
    ScriptedReplicas,
    admin_client,
    folders,
    ingress_app,
    record,
    replica,
    service,
    slow_steps,
)

pytestmark = pytest.mark.ray


# ---- a draining replica refuses before it looks the adapter up, as an engine does ------------------
def test_a_draining_replica_answers_a_name_it_does_not_know_with_the_single_server_s_503(replica, service, folders, tiny_llama_dir,
                                                                                        monkeypatch) -> None:
    """The ingress's view names A (it is refreshed every 0.5 s); the registry has unloaded it since,
    and the replica, draining, does not hold it. The replica looked A up before it checked its
    drain and answered unknown_adapter: a 404 model_not_found. A single server whose engine drains
    refuses a request for a name its routes resolve with a 503 engine_unavailable (the engine
    checks that it accepts requests before it looks the adapter up); so does the replica now."""
    from runtime.server.app import create_app
    from tests.server.conftest import client_for

    record(replica, service, "A", folders.v1)
    ingress, ray_app = ingress_app(ScriptedReplicas(replica.generate), tiny_llama_dir)
    ingress._take(service.view())
    service.unregister("A")
    single = AsyncLLMEngine(replica.engine.config)
    single.register_adapter("A", str(folders.v1))
    single_app = create_app(single)
    slow_steps(replica, 0.05, monkeypatch)
    request = {"model": "A", "prompt": "hello", "max_tokens": 2}

    async def while_draining(engine: Any, app: Any, drain: Any, draining: AsyncLLMEngine) -> Any:
        """POST ``request`` to ``app`` while ``engine`` drains (``drain()`` begins it, in a thread, and
        ``draining`` stops accepting requests) with a request in flight."""
        in_flight = engine.generate("long", "hello there", SamplingParams(max_tokens=50, ignore_eos=True), None)
        await in_flight.__anext__()
        drain()
        for _ in range(2000):
            if not draining.accepting:
                break
            await asyncio.sleep(0.005)
        try:
            async with client_for(app) as c:
                return await c.post("/v1/completions", json=request)
        finally:
            await in_flight.aclose()

    try:
        ray_answer = asyncio.run(while_draining(replica, ray_app, lambda: replica.begin_drain(20.0), replica.engine))
        single_answer = asyncio.run(while_draining(single, single_app, lambda: single.shutdown_in_background(20.0), single))
    finally:
        single.shutdown()
    assert single_answer.status_code == 503 and single_answer.json()["error"]["code"] == "engine_unavailable", single_answer.text
    assert (ray_answer.status_code, ray_answer.json()) == (single_answer.status_code, single_answer.json()), ray_answer.text


# ---- a starting ingress or replica waits for a missing registry a while, then says so in one line ---
def gone_registry(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``ray.get_actor`` answers as Ray does for a name no live actor has; returns the names asked.
    The wait for it is 0.05 s (checked every 0.01 s)."""
    from runtime.distributed import registry_lookup

    asked: list[str] = []

    def get_actor(name: str, namespace: str) -> Any:
        asked.append(name)
        raise ValueError(f"Failed to look up actor with name '{name}'. This could because 1. You are trying to look up a named actor you "
                         "didn't create. 2. The named actor died. 3. You did not use a namespace matching the namespace of the actor.")

    monkeypatch.setattr(registry_lookup.ray, "get_actor", get_actor)
    monkeypatch.setattr(registry_lookup, "REGISTRY_WAIT_S", 0.05)
    monkeypatch.setattr(registry_lookup, "REGISTRY_POLL_S", 0.01)
    return asked


def start_ingress(tiny_llama_dir: Path) -> None:
    """``LoraIngress``'s constructor, as Serve runs it, without Serve (its replicas' handle a stand-in)."""
    from runtime.distributed.ingress import LoraIngress
    from runtime.server.options import ServerOptions

    replicas = SimpleNamespace(describe=SimpleNamespace(remote=lambda: asyncio.sleep(0, {"model_name": "tiny", "max_model_len": 64})))
    written = user_class(LoraIngress)
    asyncio.run(written.__init__(object.__new__(written), replicas, str(tiny_llama_dir), ServerOptions(), "lorafleet-registry-app", "lorafleet"))


def start_replica(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LoraReplica``'s constructor, as Serve runs it, without Serve (its replica context a stand-in)."""
    from runtime.config import EngineConfig
    from runtime.distributed import replica as replica_module

    monkeypatch.setattr(replica_module.serve, "get_replica_context", lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="r1")))
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64, block_size=8, num_kv_blocks=48)
    made = object.__new__(replica_module.LoraReplica)
    try:
        asyncio.run(replica_module.LoraReplica.__init__(made, config, "lorafleet-registry-app", "lorafleet"))
    finally:
        engine = getattr(made, "engine", None)
        if engine is not None:  # the constructor got as far as building one
            engine.shutdown()


def user_class(cls: type) -> type:
    """The class lorafleet wrote that ``serve.ingress`` wrapped in ``cls``: Serve's wrapper has an
    ``__init__`` of its own, which also builds the ASGI app, and an async ``__del__``."""
    return next(c for c in cls.__mro__ if getattr(c.__dict__.get("__init__"), "__module__", "").startswith("runtime."))


@pytest.mark.parametrize("deployment", ["ingress", "replica"])
def test_a_deployment_starting_without_its_registry_waits_a_while_then_fails_in_one_line(deployment, tiny_llama_dir, monkeypatch, caplog) -> None:
    """With the registry actor gone (stopped, or a failed restart), the ingress's and the replicas'
    constructors failed at once with Ray's lookup error, a ValueError that said nothing of what to do,
    and Serve started them again and again. Now they look again for a while (one WARNING line), so a
    registry created meanwhile is found, then fail with one line naming the actor and what to do:
    what ``deploy`` shows as its start-up error (``test_serve_cli``)."""
    from runtime.distributed.registry_lookup import RegistryMissing

    asked = gone_registry(monkeypatch)
    with caplog.at_level("DEBUG", logger="lorafleet"), pytest.raises(RegistryMissing) as missing:
        start_ingress(tiny_llama_dir) if deployment == "ingress" else start_replica(tiny_llama_dir, monkeypatch)
    message = str(missing.value)
    assert message.startswith("the adapter registry actor 'lorafleet-registry-app' (namespace 'lorafleet') is not running (waited 0.05 s)")
    assert "start the application again" in message and "\n" not in message, message
    assert len(asked) > 1, "the constructor did not wait for the registry"
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert lines == ["the adapter registry actor 'lorafleet-registry-app' (namespace 'lorafleet') is not running; waiting up to 0.05 s for it"]


def test_a_registry_that_appears_during_the_wait_is_found(monkeypatch) -> None:
    from runtime.distributed import registry_lookup

    found = object()
    answers: list[Any] = [ValueError("Failed to look up actor"), ValueError("Failed to look up actor"), found]

    def get_actor(name: str, namespace: str) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(registry_lookup.ray, "get_actor", get_actor)
    assert asyncio.run(registry_lookup.find_registry("reg", "ns", wait_s=5.0, poll_s=0.0)) is found


# ---- a restarted registry holds a load only with the same --adapter-root folders --------------------
def test_a_load_whose_restarted_registry_holds_it_under_other_roots_answers_503_not_200(service, monkeypatch, tmp_path) -> None:
    """The registry restarted from its manifest between recording a load and the replicas applying
    it. The admin call compared the restarted registry's entry on version and path only: one that
    another admin call had loaded again with other --adapter-root folders (a change of its own in the
    registry) counted as this call's, and the call answered 200 for confinement not in effect. Now the
    roots are compared too: 503 registry_restarted, as for any change the restarted registry lacks."""
    checked = {"version": "1" * 64, "max_rank": 4}
    client = admin_client(service, checked, monkeypatch)
    validated = SimpleNamespace(result=lambda: checked)
    client.replicas = SimpleNamespace(validate_adapter=SimpleNamespace(remote=lambda name, path, **kw: validated))
    other_roots = AdapterRegistryService(str(tmp_path / "other-roots"))
    other_roots.register("A", "/adapters/a", checked["version"], 4, within=["/elsewhere"])
    client.registry = RestartsAfter(service, other_roots, "register")
    with pytest.raises(APIError) as refused:
        client.register("A", "/adapters/a", within=["/adapters"])
    assert (refused.value.status, refused.value.code) == (503, "registry_restarted"), refused.value.message
    same_roots = AdapterRegistryService(str(tmp_path / "same-roots"))
    same_roots.register("A", "/adapters/a", checked["version"], 4, within=["/adapters"])
    client.registry = RestartsAfter(AdapterRegistryService(str(tmp_path / "before")), same_roots, "register")
    assert client.register("A", "/adapters/a", within=["/adapters"]) == AdapterRef("A", checked["version"])


# ---- the registry checks a drain it is asked for, as the ingress does -----------------------------
@pytest.mark.parametrize("drain_s", [-5.0, float("nan"), 100.0, "20"], ids=["negative", "nan", "past-serve-s-timeout", "a-string"])
def test_the_registry_refuses_a_drain_the_ingress_would_refuse(service, drain_s) -> None:
    """``begin_drain`` is a call of a named actor that a script can make, not only the ingress after
    its check: it took a negative or NaN drain as none at all (the replicas cut their requests at
    once) and one longer than Serve's graceful shutdown timeout as it was. Now it refuses them with
    the ingress's own ValueError, and no drain begins."""
    with pytest.raises(ValueError) as ingress_says:
        check_shutdown_timeouts(drain_s)
    with pytest.raises(ValueError) as refused:
        service.begin_drain(drain_s)
    assert str(refused.value) == str(ingress_says.value)
    assert service.drain_left() is None and service.heartbeat("r1", -1, {})["drain_s"] is None


def test_the_registry_module_still_loads_without_torch() -> None:
    """The registry actor does not load torch; the drain check it now makes must not bring it in."""
    code = "import sys, runtime.distributed.registry_service; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
    assert out.stdout.strip() == "False", out.stderr


# ---- a replica's teardown ends its validation thread ------------------------------------------------
def test_the_teardown_serve_calls_ends_the_replica_s_validation_thread(replica, folders, monkeypatch) -> None:
    """Serve stops a replica by calling its ``__del__`` (``UserCallableWrapper.call_destructor``);
    that cancelled the sync task and shut the engine down, but the thread validate_adapter runs on
    (``_validations``) stayed, waiting for work that would never come. Now the teardown lets it end."""
    threads: list[threading.Thread] = []
    real = replica.engine.load_adapter_files

    def load(name: str, path: str, **kw: Any) -> Any:
        threads.append(threading.current_thread())
        return real(name, path, **kw)

    monkeypatch.setattr(replica.engine, "load_adapter_files", load)
    assert "version" in asyncio.run(replica.validate_adapter("A", str(folders.v1)))
    assert len(threads) == 1 and threads[0].name.startswith("lorafleet-admin"), threads
    replica.registry = None  # no registry to say goodbye to here
    replica.__del__()
    threads[0].join(timeout=5.0)
    assert not threads[0].is_alive(), "the replica's validation thread outlived its teardown"
    replica.__del__()  # Python may call it again when the object is collected
