"""The Ray application where it answered otherwise than a single server, or started and stopped
less cleanly: a draining replica's refusal, a missing registry actor at start-up, a restarted
registry's entry with other ``--adapter-root`` folders, the registry's own check of a drain, and a
replica's teardown. No Ray cluster: the replica, registry and ingress of ``test_ray_sync``'s
fixtures and helpers, called in process."""
from __future__ import annotations

import asyncio
import subprocess
import sys
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


