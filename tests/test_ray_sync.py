"""A replica's adapter sync with the registry, without a Ray cluster.

Each test builds a ``LoraReplica`` around a real ``AsyncLLMEngine`` on the tiny llama
(``LoraReplica._setup``: no Serve), and an ``AdapterRegistryService`` called through
``LocalHandle``, which answers ``handle.method.remote(...)`` like a Ray actor handle. The
tests drive ``_sync_once`` / ``_apply`` / ``generate`` themselves, so nothing waits on a clock.
"""
from __future__ import annotations

import asyncio
import time
import contextlib
import dataclasses
import inspect
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from runtime.async_engine import AsyncLLMEngine  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.distributed import registry_client  # noqa: E402
from runtime.distributed.registry_client import RegistryClient, ReplicasFailedToApply  # noqa: E402
from runtime.distributed.registry_service import AdapterRegistryService  # noqa: E402
from runtime.distributed.replica import LoraReplica, on_the_wire, replica_seed  # noqa: E402
from runtime.distributed.replica_set import replica_error  # noqa: E402
from runtime.request import AdapterRef, SamplingParams, UnknownAdapterError  # noqa: E402
from runtime.server.errors import APIError  # noqa: E402
from tests.engine_helpers import clone_adapter  # noqa: E402

pytestmark = pytest.mark.ray


class LocalHandle:
    """An object called like a Ray actor handle: ``handle.method.remote(*args)`` is an awaitable
    of the method's result (awaiting it too when the method is async)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.target, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        return SimpleNamespace(remote=call)


@pytest.fixture
def service(tmp_path: Path) -> AdapterRegistryService:
    return AdapterRegistryService(str(tmp_path / "registry"))


@pytest.fixture
def replica(tiny_llama_dir: Path, service: AdapterRegistryService) -> Iterator[LoraReplica]:
    """A replica of the tiny llama synced from ``service``; Serve's multiplexed loader is
    stood in for by ``_lease`` itself."""
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_loras=2, max_lora_rank=16,
                          max_cpu_loras=4, max_num_seqs=4, max_model_len=64, block_size=8, num_kv_blocks=48)
    engine = AsyncLLMEngine(config)
    rep = LoraReplica.__new__(LoraReplica)
    rep._setup(engine, LocalHandle(service), "replica-1", sync_interval_s=0.0)
    rep.load_adapter = rep._lease
    try:
        yield rep
    finally:
        engine.shutdown()
        rep.registry = rep.engine = None  # nothing left for __del__ to say goodbye to or shut down


@pytest.fixture
def folders(tiny_adapters: dict[str, Path], tmp_path: Path) -> SimpleNamespace:
    """v1: a copy of adapter "a"; v2: other weights with the same config (another version)."""
    v1 = Path(shutil.copytree(tiny_adapters["a"], tmp_path / "v1"))
    v2 = clone_adapter(v1, tmp_path / "v2", seed=7)
    return SimpleNamespace(root=tmp_path, v1=v1, v2=v2)


def record(rep: LoraReplica, service: AdapterRegistryService, name: str, path: Path) -> dict[str, Any]:
    """What the admin call does before waiting: validate the files (here, on ``rep``), record them."""
    adapter = rep.engine.engine.load_adapter_files(name, str(path))
    return service.register(name, str(path), adapter.version, adapter.max_rank)


def version_of(path: Path, rep: LoraReplica) -> str:
    return rep.engine.engine.load_adapter_files("probe", str(path)).version


def held(rep: LoraReplica) -> dict[str, tuple[str, str]]:
    """name -> (version, path) as this replica's engine holds them."""
    return {a.name: (a.version, a.path) for a in rep.engine.adapters()}


def sync(rep: LoraReplica) -> None:
    asyncio.run(rep._sync_once())


def items(rep: LoraReplica, adapter: str | None, max_tokens: int = 4, **kwargs: Any) -> list[tuple]:
    """Everything ``rep.generate`` sends for one greedy request."""

    async def run() -> list[tuple]:
        return [item async for item in rep.generate("req", "hello there", SamplingParams(max_tokens=max_tokens, ignore_eos=True), adapter, **kwargs)]

    return asyncio.run(run())


# ---- 1: a failed apply is retried, and the replica stops serving the stale version ------------------
def test_failed_hot_update_is_retried_and_the_stale_version_is_not_served(replica, service, folders) -> None:
    record(replica, service, "A", folders.v1)
    sync(replica)
    v1, v2 = version_of(folders.v1, replica), version_of(folders.v2, replica)
    assert held(replica) == {"A": (v1, str(folders.v1))}
    revision = record(replica, service, "A", folders.v2)["revision"]  # validated on another node ...
    hidden = folders.v2.rename(folders.root / "v2-not-yet-visible")  # ... not yet visible on this one
    sync(replica)
    assert "A" not in held(replica), f"replica still serves A@{held(replica).get('A')} while the registry names A@{v2[:12]} only"
    assert replica.applied_revision < revision, "a revision whose entry failed was counted as applied: it would never be retried"
    assert any(e.startswith("A: ") for e in replica.apply_errors), replica.apply_errors
    refused = items(replica, "A")
    assert [i[:2] for i in refused] == [("error", "adapter_unavailable")], refused
    assert "retry" in refused[0][2], refused
    as_http = replica_error(*refused[0][1:])
    assert isinstance(as_http, APIError) and as_http.status == 503, as_http
    hidden.rename(folders.v2)  # the files show up: the next sync retries and succeeds
    sync(replica)
    assert held(replica) == {"A": (v2, str(folders.v2))}
    assert replica.applied_revision == revision and replica.apply_errors == ()
    assert items(replica, "A")[-1][1].adapter.version == v2


def test_a_name_whose_update_failed_is_unavailable_while_the_rest_of_the_revision_applies(replica, service, folders, monkeypatch) -> None:
    """A's update fails and the replica drops A@v1; the revision's other entries are read next
    (seconds for large adapters). Meanwhile a request for A (Serve's cache still holds its lease)
    got a 404 unknown_adapter for a registered adapter: the replica learned that A is only
    unavailable at the end of the apply. Now it knows at once: 503 adapter_unavailable."""
    record(replica, service, "A", folders.v1)
    record(replica, service, "B", folders.v1)
    sync(replica)
    record(replica, service, "A", folders.v2)
    folders.v2.rename(folders.root / "v2-not-yet-visible")
    record(replica, service, "B", Path(shutil.copytree(folders.v1, folders.root / "b-moved")))  # read after A's failure

    async def cached_lease(name: str) -> Any:  # what Serve's cache answers for a name it holds
        return SimpleNamespace(name=name)

    replica.load_adapter = cached_lease
    during: list[list[tuple]] = []
    real = replica.engine.load_adapter_files

    def load(name: str, path: str, **kw: Any) -> Any:
        if name == "B":
            during.append(items(replica, "A"))
        return real(name, path, **kw)

    monkeypatch.setattr(replica.engine, "load_adapter_files", load)
    sync(replica)
    assert [[i[:2] for i in got] for got in during] == [[("error", "adapter_unavailable")]], during


def admin_client(service: AdapterRegistryService, checked: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> RegistryClient:
    """The admin path's RegistryClient over ``service``: ``ray.get`` runs the local call, and the
    files validate (on some replica) as ``checked``; waits time out at once."""
    monkeypatch.setattr(registry_client, "ray", SimpleNamespace(get=asyncio.run))
    validated = SimpleNamespace(result=lambda: checked)
    replicas = SimpleNamespace(validate_adapter=SimpleNamespace(remote=lambda name, path: validated))
    return RegistryClient(LocalHandle(service), replicas, apply_timeout_s=0.0)


def test_admin_call_reports_a_replica_that_failed_to_apply_and_succeeds_once_it_caught_up(replica, service, folders, monkeypatch) -> None:
    record(replica, service, "A", folders.v1)
    sync(replica)
    v2 = version_of(folders.v2, replica)
    revision = record(replica, service, "A", folders.v2)["revision"]
    hidden = folders.v2.rename(folders.root / "v2-not-yet-visible")
    sync(replica)
    report = asyncio.run(service.wait_applied(revision, timeout_s=0.0))
    assert report["lagging"] == [], f"a replica that tried revision {revision} and reported errors is done with it, not lagging: {report}"
    assert list(report["errors"]) == ["replica-1"], report
    client = admin_client(service, {"version": v2, "max_rank": 4}, monkeypatch)
    with pytest.raises(ReplicasFailedToApply) as failed:  # posting the same load again: no new revision, same answer
        client.register("A", str(folders.v2))
    assert failed.value.status == 503, failed.value.status
    assert "replica-1" in failed.value.message and "'A'" in failed.value.message and "does not exist" in failed.value.message, failed.value.message
    hidden.rename(folders.v2)
    sync(replica)
    assert client.register("A", str(folders.v2)).version == v2


def test_validations_wait_on_a_bounded_thread_of_their_own_and_one_too_many_is_a_429(replica, service, folders, monkeypatch) -> None:
    """A replica validated an admin call's files on its event loop's default executor, the threads its
    heartbeats' snapshots and its applies wait for, as many at once as admin calls were in progress.
    Now they wait on a thread of their own (AdminWorkers, as a single server's admin routes do), and
    one past ADMIN_MAX_IN_PROGRESS gets the admin route's 429 (AdminBusy), not a 400."""
    from runtime.server.admin_workers import AdminBusy, AdminWorkers

    read = replica.engine.load_adapter_files
    release, threads = threading.Event(), []

    def slow_read(name: str, path: str, within: Any = None) -> Any:
        threads.append(threading.current_thread().name)
        if len(threads) == 1:  # the first read is held until the second call was answered
            release.wait()
        return read(name, path, within=within)

    monkeypatch.setattr(replica.engine, "load_adapter_files", slow_read)
    replica._validations = AdminWorkers(threads=1, max_in_progress=1)  # ADMIN_MAX_IN_PROGRESS, made small

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        first = asyncio.ensure_future(replica.validate_adapter("A", str(folders.v1)))
        for _ in range(20_000):  # a bound, not a clock: until the first one reads
            if threads:
                break
            await asyncio.sleep(0.001)
        second = await replica.validate_adapter("B", str(folders.v1))
        release.set()
        return await first, second

    first, second = asyncio.run(run())
    assert first == {"version": version_of(folders.v1, replica), "max_rank": first["max_rank"]}, first
    assert threads == ["lorafleet-admin_0"], threads
    assert list(second) == ["busy"] and "replica-1" in second["busy"], second
    client = admin_client(service, second, monkeypatch)
    with pytest.raises(AdminBusy):
        client.register("B", str(folders.v1))
    assert service.manifest.by_name() == {}


def test_a_load_whose_validating_replica_dies_answers_503_to_retry_not_500(service, monkeypatch) -> None:
    """The replica that validates a load's files can die meanwhile (Serve replaces an unhealthy one):
    Ray's RayActorError came out of the admin route as a 500 internal_error, as if lorafleet had a
    bug. Now it is a 503 replica_unavailable saying nothing was recorded and to retry."""
    import ray

    client = admin_client(service, {}, monkeypatch)

    def died() -> Any:
        raise ray.exceptions.RayActorError()

    client.replicas = SimpleNamespace(validate_adapter=SimpleNamespace(remote=lambda name, path: SimpleNamespace(result=died)))
    with pytest.raises(APIError) as refused:
        client.register("A", "/adapters/a")
    assert (refused.value.status, refused.value.code) == (503, "replica_unavailable"), refused.value.message
    assert "nothing was recorded" in refused.value.message and "retry" in refused.value.message, refused.value.message
    assert service.manifest.by_name() == {}


def test_a_load_validated_on_a_replica_whose_engine_is_gone_answers_503_to_retry(replica, service, folders, monkeypatch) -> None:
    """A replica whose engine is gone (shut down here; a replica whose step failed still validates,
    and Serve replaces it after its health checks) raised EngineDeadError from validate_adapter: Ray carried it to the admin route as its wrapped
    error (RayTaskError, whose text is the remote traceback), not one the admin path answers as
    such, and at start-up (--lora-modules) it was a traceback. Now the replica says so and the
    call is a 503 replica_unavailable to retry (another replica validates it)."""
    monkeypatch.setattr(registry_client, "ray", SimpleNamespace(get=asyncio.run))
    replicas = SimpleNamespace(validate_adapter=SimpleNamespace(
        remote=lambda name, path, **kw: SimpleNamespace(result=lambda: asyncio.run(replica.validate_adapter(name, path, **kw)))))
    client = RegistryClient(LocalHandle(service), replicas, apply_timeout_s=0.0)
    replica.engine.shutdown()
    with pytest.raises(APIError) as refused:
        client.register("A", str(folders.v1))
    assert (refused.value.status, refused.value.code) == (503, "replica_unavailable"), refused.value.message
    message = refused.value.message
    assert message.startswith("load 'A': ") and "replica-1" in message and "retry the request" in message and "\n" not in message, message
    assert service.manifest.by_name() == {}


@pytest.mark.parametrize("name", ["__other__", "__base__", " A", "", 7])
def test_the_admin_path_refuses_a_name_as_a_single_server_does(service, monkeypatch, name) -> None:
    """RegistryClient had its own copy of the name check: a reserved name (a label of its own in
    per-adapter metrics) reached the registry once a replica's files validated, and a non-str was a
    ValueError where a single server raises TypeError. Now it is the engine's check_adapter_name:
    the same exception and message, before a replica is asked or anything is recorded."""
    from runtime.engine import check_adapter_name

    with pytest.raises((TypeError, ValueError)) as single:
        check_adapter_name(name)
    client = admin_client(service, {"version": "0" * 64, "max_rank": 4}, monkeypatch)
    asked: list[str] = []
    client.replicas = SimpleNamespace(validate_adapter=SimpleNamespace(remote=lambda n, p: asked.append(n)))
    with pytest.raises((TypeError, ValueError)) as refused:
        client.register(name, "/adapters/a")
    assert (type(refused.value), str(refused.value)) == (type(single.value), str(single.value))
    assert asked == [] and service.manifest.by_name() == {}


class RestartsAfter:
    """A registry actor handle whose actor restarts as soon as ``method`` answered: every later
    call reaches ``after`` (a new ``AdapterRegistryService``, with its own incarnation)."""

    def __init__(self, before: AdapterRegistryService, after: AdapterRegistryService, method: str) -> None:
        self.before, self.after, self.method, self.restarted = before, after, method, False
        self.waits: list[tuple[Any, ...]] = []  # (revision, registry) of each wait_applied call

    def __getattr__(self, name: str) -> Any:
        call = getattr(LocalHandle(self.after if self.restarted else self.before), name).remote

        async def remote(*args: Any, **kwargs: Any) -> Any:
            if name == "wait_applied":
                self.waits.append((args[0], kwargs.get("registry")))
            result = await call(*args, **kwargs)
            self.restarted = self.restarted or name == self.method
            return result

        return SimpleNamespace(remote=remote)


def test_an_admin_call_whose_registry_restarted_without_the_change_answers_503_not_200(service, monkeypatch, tmp_path) -> None:
    """The registry restarted between recording a load and the wait for the replicas: the call
    waited for that revision number in the new registry's sequence, logged lagging replicas and
    answered 200 although the new registry (its manifest lost) did not hold the adapter. Now the
    wait sees another registry actor, and the call answers 503 registry_restarted (retry) unless
    that one holds the change (restarted from its manifest: then the call waits on its revision)."""
    checked = {"version": "1" * 64, "max_rank": 4}
    client = admin_client(service, checked, monkeypatch)
    lost = AdapterRegistryService(str(tmp_path / "manifest-lost"))
    client.registry = RestartsAfter(service, lost, "register")
    with pytest.raises(APIError) as refused:
        client.register("A", "/adapters/a")
    assert (refused.value.status, refused.value.code) == (503, "registry_restarted"), refused.value.message
    assert "sending it again" in refused.value.message and lost.manifest.by_name() == {}
    # Restarted from its manifest, but another admin call has replaced the adapter since: the same 503,
    # whose message must not claim the manifest was lost (sending the load again would undo that call).
    superseded = AdapterRegistryService(str(shutil.copytree(service.folder(), tmp_path / "superseded")))
    superseded.register("A", "/adapters/a-newer", "3" * 64, 4)
    client.registry = RestartsAfter(service, superseded, "register")
    with pytest.raises(APIError) as refused:
        client.register("A", "/adapters/a")
    assert (refused.value.status, refused.value.code) == (503, "registry_restarted"), refused.value.message
    assert "another admin call has changed this adapter since" in refused.value.message, refused.value.message
    assert "GET /v1/models" in refused.value.message
    # Restarted from its manifest: it holds the load, and the call waits for the replicas on its current revision.
    kept = AdapterRegistryService(service.folder())
    kept.register("B", "/adapters/b", "2" * 64, 4)  # another change after the restart
    client.registry = restarts = RestartsAfter(service, kept, "register")
    assert client.register("A", "/adapters/a") == AdapterRef("A", checked["version"])  # the same load again: no new revision
    assert restarts.waits == [(1, service.incarnation), (2, kept.incarnation)], restarts.waits
    # An unload: a registry that does not hold the name holds the change.
    client.registry = RestartsAfter(kept, AdapterRegistryService(str(tmp_path / "lost-again")), "unregister")
    client.unregister("A")


class GoneRegistry:
    """A registry actor handle whose actor is gone for good: every call raises Ray's RayActorError."""

    def __getattr__(self, name: str) -> Any:
        async def remote(*args: Any, **kwargs: Any) -> Any:
            import ray

            raise ray.exceptions.RayActorError()

        return SimpleNamespace(remote=remote)


class GoesAwayAt(RestartsAfter):
    """A registry actor handle whose actor is gone for good from its call of ``method`` on (that call
    raises Ray's RayActorError, as every later one does)."""

    def __init__(self, service: AdapterRegistryService, method: str) -> None:
        super().__init__(service, service, method)

    def __getattr__(self, name: str) -> Any:
        if name == self.method or self.restarted:
            self.restarted = True
            return GoneRegistry().__getattr__(name)
        return super().__getattr__(name)


@pytest.mark.parametrize("method, recorded", [("register", None), ("wait_applied", True)])
def test_a_load_whose_registry_is_gone_answers_503_saying_whether_it_was_recorded(service, monkeypatch, method, recorded) -> None:
    """A registry actor gone for good (stopped, or unable to restart) came out of the admin route as
    Ray's RayActorError, a 500 internal_error, as if lorafleet had a bug. Now it is a 503
    registry_unavailable whose message says whether the change was recorded."""
    client = admin_client(service, {"version": "1" * 64, "max_rank": 4}, monkeypatch)
    client.registry = GoesAwayAt(service, method)
    with pytest.raises(APIError) as refused:
        client.register("A", "/adapters/a")
    assert (refused.value.status, refused.value.code) == (503, "registry_unavailable"), refused.value.message
    message = refused.value.message
    assert message.startswith("register A@111") and "registry actor is unavailable (RayActorError" in message, message
    if recorded:
        assert "the change is recorded" in message and "not known" not in message, message
    else:
        assert "whether the change was recorded is not known" in message and "GET /v1/models" in message, message


def test_an_unload_whose_registry_is_gone_answers_503_and_a_404_stands_without_the_list(service, monkeypatch) -> None:
    """The same 503 for an unload; and an unload the registry refused (the name is not registered)
    stays a 404 when the registry goes before it lists the registered names."""
    client = admin_client(service, {}, monkeypatch)
    service.register("A", "/adapters/a", "1" * 64, 4)
    client.registry = GoesAwayAt(service, "unregister")
    with pytest.raises(APIError) as refused:
        client.unregister("A")
    assert (refused.value.status, refused.value.code) == (503, "registry_unavailable"), refused.value.message
    assert refused.value.message.startswith("unregister A: "), refused.value.message
    client.registry = GoesAwayAt(service, "state")
    with pytest.raises(UnknownAdapterError, match=r"^adapter 'B' is not registered$"):
        client.unregister("B")


class RaisesInRay(LocalHandle):
    """A registry actor handle whose calls raise as Ray raises an exception of the actor's method:
    a ``RayTaskError`` that is also an instance of the method's exception class (so an OSError there
    is an OSError here, a ValueError a ValueError), its text the remote traceback."""

    def __getattr__(self, name: str) -> Any:
        call = super().__getattr__(name).remote

        async def remote(*args: Any, **kwargs: Any) -> Any:
            import ray

            try:
                return await call(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - what Ray hands the caller instead
                raise ray.exceptions.RayTaskError(f"AdapterRegistryService.{name}", f"Traceback (most recent call last):\n  ...\n"
                                                  f"{type(err).__name__}: {err}", err).as_instanceof_cause() from None

        return SimpleNamespace(remote=remote)


@pytest.mark.parametrize("call", ["register", "unregister"])
def test_a_registry_that_fails_to_record_an_admin_call_answers_500_naming_why_not_a_400_on_the_files(service, monkeypatch, call) -> None:
    """The registry actor's own call raised (it could not write adapters.json under --registry-dir:
    disk full, no permission). Ray raises that as an exception of the cause's class, so an OSError
    reached the admin route's handler for unreadable adapter files: a 400 invalid_adapter "cannot
    read <the registry's temp file>" (a ValueError: a 400 whose message was the remote traceback),
    blaming the client's files for the server's disk. Now it is a 500 registry_error naming the
    error in one line; nothing was recorded."""
    client = admin_client(service, {"version": "1" * 64, "max_rank": 4}, monkeypatch)
    service.register("A", "/adapters/a", "2" * 64, 4)
    before = service.manifest

    def disk_full(manifest: Any) -> None:
        raise OSError(28, "No space left on device", str(Path(service.folder()) / ".adapters.tmp"))

    monkeypatch.setattr(service.store, "save", disk_full)
    client.registry = RaisesInRay(service)
    with pytest.raises(APIError) as refused:
        client.register("A", "/adapters/a") if call == "register" else client.unregister("A")
    message = refused.value.message
    assert (refused.value.status, refused.value.code) == (500, "registry_error"), message
    what = f"register A@{'1' * 64}" if call == "register" else "unregister A"
    assert message.startswith(f"{what}: the adapter registry failed (OSError: [Errno 28] No space left on device"), message
    assert "Traceback" not in message and "\n" not in message, message
    assert service.manifest == before


def test_initial_adapters_are_all_validated_before_any_is_recorded(replica, service, folders, monkeypatch, tmp_path) -> None:
    """A start whose --lora-modules hold one adapter that does not load recorded the ones before it,
    and the next start (no --lora-modules) served them from the registry; now none is recorded."""
    monkeypatch.setattr(registry_client, "ray", SimpleNamespace(get=asyncio.run))
    replicas = SimpleNamespace(validate_adapter=SimpleNamespace(
        remote=lambda name, path: SimpleNamespace(result=lambda: asyncio.run(replica.validate_adapter(name, path)))))
    client = RegistryClient(LocalHandle(service), replicas, apply_timeout_s=0.0)
    before = service.manifest.revision
    with pytest.raises(ValueError, match="adapter folder does not exist"):
        client.register_all([("good", str(folders.v1)), ("bad", str(tmp_path / "nowhere"))])
    assert service.manifest.revision == before and service.manifest.by_name() == {}
    refs = client.register_all([("good", str(folders.v1)), ("other", str(folders.v2))])
    assert [r.name for r in refs] == ["good", "other"] and set(service.manifest.by_name()) == {"good", "other"}


def test_an_admin_load_confines_the_validating_replicas_read(replica, service, folders, monkeypatch) -> None:
    """The admin route's --adapter-root reaches the replica that reads the files to validate them:
    files that resolve outside it when that replica opens them are refused, nothing recorded."""
    monkeypatch.setattr(registry_client, "ray", SimpleNamespace(get=asyncio.run))
    replicas = SimpleNamespace(validate_adapter=SimpleNamespace(
        remote=lambda name, path, **kw: SimpleNamespace(result=lambda: asyncio.run(replica.validate_adapter(name, path, **kw)))))
    client = RegistryClient(LocalHandle(service), replicas, apply_timeout_s=0.0)
    before = service.manifest.revision
    with pytest.raises(ValueError, match="resolves outside every --adapter-root"):
        client.register("A", str(folders.v1), within=[str(folders.v2)])
    assert service.manifest.revision == before and service.manifest.by_name() == {}
    assert client.validate("A", str(folders.v1), within=[str(folders.v1)])["version"]


def test_a_path_refusal_on_ray_answers_the_single_server_s_403(replica, service, folders, monkeypatch, tmp_path, tiny_llama_dir) -> None:
    """A weights file swapped for a symlink out of --adapter-root after the admin route's check is
    refused by the loader. A single server answers 403 path_not_allowed; on Ray the validating
    replica's refusal came back as a plain message, a ValueError, so the ingress answered 400
    invalid_adapter. Now its kind crosses the wire: the same status, code and message."""
    import runtime.server.admin as admin_module
    from runtime.lora.adapter import WEIGHTS_FILE
    from runtime.server.app import create_app
    from runtime.server.options import ServerOptions

    root = tmp_path / "root"
    folder = Path(shutil.copytree(folders.v1, root / "swapped"))
    outside = folders.v2
    options = ServerOptions(enable_adapter_admin=True, adapter_roots=(root,))
    confine = admin_module.confine_adapter_folder

    def confine_then_swap(*args: Any) -> Any:
        path = confine(*args)
        (folder / WEIGHTS_FILE).unlink()
        (folder / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)
        return path

    monkeypatch.setattr(admin_module, "confine_adapter_folder", confine_then_swap)
    ingress = local_ingress(replica, service, tiny_llama_dir, monkeypatch)

    def load(app: Any) -> Any:
        (folder / WEIGHTS_FILE).unlink()
        shutil.copy2(folders.v1 / WEIGHTS_FILE, folder / WEIGHTS_FILE)  # a regular file inside the root again
        return admin_load(app, "swapped", folder)

    single, on_ray = load(create_app(replica.engine, options)), load(create_app(ingress, options))
    assert single.status_code == 403 and single.json()["error"]["code"] == "path_not_allowed", single.text
    assert (on_ray.status_code, on_ray.json()) == (single.status_code, single.json()), (on_ray.text, single.text)
    assert service.manifest.by_name() == {} and "swapped" not in {a.name for a in replica.engine.adapters()}


def test_an_unreadable_adapter_file_on_ray_answers_the_single_server_s_400(replica, service, folders, monkeypatch, tmp_path,
                                                                          tiny_llama_dir) -> None:
    """A weights file the server may not read (permission denied). A single server answers 400
    invalid_adapter "lora_path '...': cannot read FILE: Permission denied"; on Ray the validating
    replica's OSError came back as its bare text, a ValueError: 400 "[Errno 13] Permission denied:
    'FILE'". Now its parts cross the wire: the same status, code and message. (The denial is stood
    in for: as root, a chmod would not deny the read.)"""
    import runtime.lora.adapter as adapter_module
    from runtime.lora.adapter import WEIGHTS_FILE
    from runtime.server.app import create_app
    from runtime.server.options import ServerOptions

    root = tmp_path / "root"
    folder = Path(shutil.copytree(folders.v1, root / "locked"))
    options = ServerOptions(enable_adapter_admin=True, adapter_roots=(root,))
    real_open = adapter_module.open_symlink_free

    def open_denied(resolved: str) -> Any:
        if resolved.endswith(WEIGHTS_FILE):
            raise PermissionError(13, "Permission denied", resolved)
        return real_open(resolved)

    monkeypatch.setattr(adapter_module, "open_symlink_free", open_denied)
    ingress = local_ingress(replica, service, tiny_llama_dir, monkeypatch)

    def load(app: Any) -> Any:
        return admin_load(app, "locked", folder)

    single, on_ray = load(create_app(replica.engine, options)), load(create_app(ingress, options))
    assert single.status_code == 400 and single.json()["error"]["code"] == "invalid_adapter", single.text
    assert single.json()["error"]["message"].endswith(f"cannot read {folder / WEIGHTS_FILE}: Permission denied"), single.text
    assert (on_ray.status_code, on_ray.json()) == (single.status_code, single.json()), (on_ray.text, single.text)
    assert service.manifest.by_name() == {} and "locked" not in {a.name for a in replica.engine.adapters()}


def test_every_replica_s_read_of_an_admin_load_stays_in_the_adapter_root(replica, service, folders, monkeypatch, tmp_path) -> None:
    """Only the replica validating an admin load confined its read to --adapter-root: the registry
    recorded name, path and version, and each replica applying the change read the recorded path
    unconfined, so a weights file swapped for a symlink out of the root after the validation was
    read (its content hashing to the validated version is all that was checked). The roots are
    now recorded with the entry, and survive a registry restart from its manifest; each replica's
    read is confined to them. A manifest written before (no "within") still loads, unconfined."""
    import json

    from runtime.lora.adapter import WEIGHTS_FILE

    monkeypatch.setattr(registry_client, "ray", SimpleNamespace(get=asyncio.run))
    replicas = SimpleNamespace(validate_adapter=SimpleNamespace(
        remote=lambda name, path, **kw: SimpleNamespace(result=lambda: asyncio.run(replica.validate_adapter(name, path, **kw)))))
    client = RegistryClient(LocalHandle(service), replicas, apply_timeout_s=0.0)
    root, outside = tmp_path / "root", Path(shutil.copytree(folders.v1, tmp_path / "outside"))
    folder = Path(shutil.copytree(folders.v1, root / "a"))
    version = client.register("A", str(folder), within=[str(root)]).version
    assert service.manifest.by_name()["A"].within == (str(root),)
    assert AdapterRegistryService(service.folder()).manifest.by_name()["A"].within == (str(root),)  # a restarted registry keeps them
    (folder / WEIGHTS_FILE).unlink()
    (folder / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)  # the same bytes, outside the root
    sync(replica)
    assert "A" not in held(replica), "a replica read the registered path out of --adapter-root"
    assert any(e.startswith("A: ") and "resolves outside every --adapter-root" in e for e in replica.apply_errors), replica.apply_errors
    (folder / WEIGHTS_FILE).unlink()
    shutil.copy2(outside / WEIGHTS_FILE, folder / WEIGHTS_FILE)  # back inside the root: applied
    sync(replica)
    assert held(replica) == {"A": (version, str(folder))} and replica.apply_errors == ()
    # An entry of a manifest written before the field: no confinement recorded, read as before.
    manifest = Path(service.folder()) / "adapters.json"
    doc = json.loads(manifest.read_text())
    assert doc["adapters"]["A"]["within"] == [str(root)]
    del doc["adapters"]["A"]["within"]
    manifest.write_text(json.dumps(doc))
    assert AdapterRegistryService(service.folder()).state()["entries"][0]["within"] is None
    doc["adapters"]["A"]["within"] = str(root)
    manifest.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"adapters\.A\.within: expected a list of folders"):
        AdapterRegistryService(service.folder())


def local_ingress(replica: Any, service: Any, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ReplicaSetEngine over ``replica`` and the registry ``service``, their Ray calls made in
    process (``ray.get`` runs the coroutine)."""
    from runtime.distributed.replica_set import ReplicaSetEngine

    for module in (registry_client, replica_set_module()):
        monkeypatch.setattr(module, "ray", SimpleNamespace(get=asyncio.run))
    replicas = SimpleNamespace(validate_adapter=SimpleNamespace(
        remote=lambda name, path, **kw: SimpleNamespace(result=lambda: asyncio.run(replica.validate_adapter(name, path, **kw)))))
    return ReplicaSetEngine(replicas, LocalHandle(service), str(model_dir), "tiny", 64, apply_timeout_s=0.0)


def admin_load(app: Any, name: str, folder: Path) -> Any:
    """POST /v1/load_lora_adapter of ``folder`` as ``name`` to ``app``: the response."""
    from tests.server.conftest import client_for

    async def run() -> Any:
        async with client_for(app) as c:
            return await c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})

    return asyncio.run(run())


def replica_set_module() -> Any:
    from runtime.distributed import replica_set

    return replica_set


# ---- 2: files are checked against the registered version before they are installed ----------------
def spy_installs(rep: LoraReplica, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Versions the engine makes current (install_adapter calls), in order."""
    installed: list[str] = []
    real = rep.engine.engine.install_adapter

    def install(adapter: Any, path: str) -> Any:
        installed.append(adapter.version)
        return real(adapter, path)

    monkeypatch.setattr(rep.engine.engine, "install_adapter", install)
    return installed


def overwrite(folder: Path, source: Path) -> None:
    """Replace the adapter files in ``folder`` by those of ``source`` (the files changed on disk)."""
    for f in source.iterdir():
        shutil.copy2(f, folder / f.name)


def test_files_changed_after_validation_are_never_installed(replica, service, folders, monkeypatch) -> None:
    record(replica, service, "A", folders.v1)
    sync(replica)
    record(replica, service, "A", folders.v2)  # the registry validated v2 ...
    v3 = version_of(clone_adapter(folders.v1, folders.root / "v3", seed=11), replica)
    overwrite(folders.v2, folders.root / "v3")  # ... then the files changed
    installed = spy_installs(replica, monkeypatch)
    sync(replica)
    assert v3 not in installed, f"the unverified version {v3} became current (requests could bind to it)"
    assert "A" not in held(replica), f"the registry names another version than {held(replica).get('A')}: A must be unavailable here"
    assert any(e.startswith("A: ") and "now has version" in e for e in replica.apply_errors), replica.apply_errors


def replace_files(folder: Path, source: Path) -> None:
    """Put ``source``'s adapter files in ``folder`` as tools do: a new file renamed over each one."""
    for f in source.iterdir():
        shutil.copyfile(f, folder / f".{f.name}.tmp")
        (folder / f".{f.name}.tmp").replace(folder / f.name)


def test_a_broken_entry_is_read_again_only_once_its_folder_changed_or_a_backoff_passed(replica, service, folders, monkeypatch) -> None:
    """A registered entry whose files do not apply kept the replica behind, and every heartbeat
    (4 a second) read and hashed its files again, for as long as nobody fixed the folder. Now they
    are read again once the backoff passes (1 s, doubling), or at once when the folder changes."""
    now = [1000.0]
    replica._clock = lambda: now[0]
    record(replica, service, "A", folders.v1)
    sync(replica)
    v2 = version_of(folders.v2, replica)
    good = Path(shutil.copytree(folders.v2, folders.root / "v2-good"))
    revision = record(replica, service, "A", folders.v2)["revision"]  # validated ...
    replace_files(folders.v2, clone_adapter(folders.v1, folders.root / "v3", seed=11))  # ... then broken on disk
    reads: list[str] = []
    real = replica.engine.load_adapter_files

    def load(name: str, path: str, **kw: Any) -> Any:
        reads.append(name)
        return real(name, path, **kw)

    monkeypatch.setattr(replica.engine, "load_adapter_files", load)
    for _ in range(5):
        sync(replica)
    assert reads == ["A"], f"the broken entry's files were read at each of 5 heartbeats within a second: {reads}"
    error = replica.apply_errors
    assert len(error) == 1 and "now has version" in error[0] and replica.applied_revision < revision, (error, replica.applied_revision)
    now[0] += 1.0  # the first backoff passed
    sync(replica)
    sync(replica)
    assert reads == ["A", "A"] and replica.apply_errors == error, (reads, replica.apply_errors)
    now[0] += 1.0  # the second one is twice as long
    sync(replica)
    assert reads == ["A", "A"], reads
    now[0] += 1.0
    sync(replica)
    assert reads == ["A", "A", "A"], reads
    replace_files(folders.v2, good)  # fixed: the next heartbeat reads it, whatever the backoff
    sync(replica)
    assert reads == ["A", "A", "A", "A"], reads
    assert held(replica) == {"A": (v2, str(folders.v2))} and replica.applied_revision == revision and replica.apply_errors == ()


def test_an_entry_loaded_again_under_other_adapter_roots_is_read_at_once(replica, service, folders, tmp_path) -> None:
    """A failed entry was held back (its last error reported, its files not read) until its folder
    changed or the backoff passed, keyed on (path, version) only: loading the same files again with
    other --adapter-root folders recorded the new roots, but the replicas kept the old refusal for
    up to 30 s, and the admin call answered 503 replicas_failed_to_apply with it. The roots are part
    of the key now."""
    from runtime.lora.adapter import WEIGHTS_FILE

    now = [1000.0]
    replica._clock = lambda: now[0]
    first, second = tmp_path / "root1", tmp_path / "root2"
    folder = Path(shutil.copytree(folders.v1, first / "a"))
    second.mkdir()
    (folder / WEIGHTS_FILE).replace(second / WEIGHTS_FILE)
    (folder / WEIGHTS_FILE).symlink_to(second / WEIGHTS_FILE)  # the weights live under the second root
    version = version_of(folder, replica)
    service.register("A", str(folder), version, 8, within=[str(first)])
    sync(replica)
    assert "A" not in held(replica) and any("resolves outside every --adapter-root" in e for e in replica.apply_errors), replica.apply_errors
    revision = service.register("A", str(folder), version, 8, within=[str(first), str(second)])["revision"]  # the same files, both roots
    sync(replica)  # the same instant: only the key can say that this entry is another one
    assert held(replica) == {"A": (version, str(folder))} and replica.apply_errors == (), replica.apply_errors
    assert replica.applied_revision == revision


# ---- 4: the same content registered at a new path moves the replica to that path ------------------
def test_same_content_at_a_new_path_is_installed_from_the_new_path(replica, service, folders) -> None:
    record(replica, service, "A", folders.v1)
    sync(replica)
    v1 = version_of(folders.v1, replica)
    moved = Path(shutil.copytree(folders.v1, folders.root / "v1-moved"))
    revision = record(replica, service, "A", moved)["revision"]
    sync(replica)
    assert held(replica) == {"A": (v1, str(moved))}, "the engine still reads A from the old folder (later reloads fail once it is removed)"
    assert replica.applied_revision == revision
    # The same version at yet another path whose files changed meanwhile: the held copy is
    # still the registered version, so it keeps serving it (from where it was checked).
    again = Path(shutil.copytree(folders.v1, folders.root / "v1-again"))
    record(replica, service, "A", again)
    overwrite(again, folders.v2)
    sync(replica)
    assert held(replica) == {"A": (v1, str(moved))}
    assert any(e.startswith("A: ") and "now has version" in e for e in replica.apply_errors), replica.apply_errors


# ---- 3: the sync loop outlives unexpected errors, and check_health reports a sync that stopped ------
class FlakyRegistry:
    """``service`` whose first ``failures`` heartbeats raise ``error``; ``calls`` counts heartbeats."""

    def __init__(self, service: AdapterRegistryService, failures: int, error: Exception) -> None:
        self.service, self.failures, self.error, self.calls = service, failures, error, 0

    def heartbeat(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self.service.heartbeat(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.service, name)


async def run_sync_loop_until(rep: LoraReplica, done: Any) -> None:
    """Run ``rep._sync_loop`` until ``done()`` holds; fail at once if the loop ends first."""
    rep._sync_task = asyncio.create_task(rep._sync_loop())
    for _ in range(20_000):  # a bound, not a clock: each turn yields to the loop once
        if rep._sync_task.done():
            raise AssertionError(f"the sync loop ended: {rep._sync_task.exception()!r}")
        if done():
            break
        await asyncio.sleep(0.001)
    rep._sync_task.cancel()
    await asyncio.gather(rep._sync_task, return_exceptions=True)
    rep._sync_task = None  # stopped here on purpose, not ended


def test_sync_loop_keeps_syncing_after_unexpected_errors(replica, service, folders) -> None:
    revision = record(replica, service, "A", folders.v1)["revision"]
    flaky = FlakyRegistry(service, failures=3, error=KeyError("entries"))
    replica.registry = LocalHandle(flaky)
    asyncio.run(run_sync_loop_until(replica, lambda: replica.applied_revision == revision))
    assert flaky.calls > 3 and "A" in held(replica)


def test_check_health_fails_when_the_sync_task_ended(replica) -> None:
    async def crash() -> None:
        raise KeyError("entries")

    async def ended() -> asyncio.Task:
        task = asyncio.create_task(crash())
        await asyncio.gather(task, return_exceptions=True)
        return task

    replica.check_health()
    replica._sync_task = asyncio.run(ended())
    with pytest.raises(RuntimeError, match="sync task ended"):
        replica.check_health()


def test_a_replica_whose_engine_is_gone_says_so_in_one_line_and_stops_syncing(replica, monkeypatch, caplog) -> None:
    """After a shutdown that gave up on a stuck step, the engine's lock refuses every snapshot with
    EngineDeadError: the sync loop logged an ERROR with a traceback ("adapter sync failed") and
    kept heartbeating for nothing until Serve deleted the replica. Now one WARNING line says the
    engine is gone, and the loop ends."""
    from runtime.async_engine import EngineDeadError

    snapshots = [0]

    def gone() -> Any:
        snapshots[0] += 1
        raise EngineDeadError("engine was shut down while a step was still running")

    monkeypatch.setattr(replica.engine, "snapshot", gone)

    async def run() -> bool:
        task = asyncio.create_task(replica._sync_loop())
        for _ in range(20_000):  # a bound, not a clock: each turn yields to the loop once
            if task.done() or snapshots[0] >= 3:
                break
            await asyncio.sleep(0.001)
        ended = task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return ended

    with caplog.at_level("DEBUG", logger="lorafleet"):
        ended = asyncio.run(run())
    lines = [r for r in caplog.records if r.name == "lorafleet.replica"]
    assert [(r.levelname, r.exc_info) for r in lines] == [("WARNING", None)], [(r.levelname, r.getMessage()) for r in lines]
    assert "engine is gone" in lines[0].getMessage(), lines[0].getMessage()
    assert ended and snapshots[0] == 1, f"the sync loop went on ({snapshots[0]} snapshots asked)"


def test_requests_reaching_a_replica_whose_engine_is_gone_are_refused_alike_and_logged_once(replica, service, folders, caplog) -> None:
    """Each request behind the ingress's revision makes a replica sync first; on a replica whose engine
    is gone (shut down, Serve not done deleting it) every such sync failed, and each request logged
    its own WARNING: one line per request under load. Now the first failure is logged, and every
    request is still refused with the same error."""
    record(replica, service, "A", folders.v1)
    sync(replica)
    revision = record(replica, service, "B", folders.v1)["revision"]  # the ingress knows it; the replica has not applied it
    replica.engine.shutdown()
    with caplog.at_level("DEBUG", logger="lorafleet"):
        answers = [items(replica, "A", min_revision=revision) for _ in range(3)]
    assert all(len(a) == 1 and a[0][:2] == ("error", "engine_dead") for a in answers), answers
    assert len({a[0] for a in answers}) == 1, answers
    lines = [r for r in caplog.records if r.name == "lorafleet.replica" and r.levelname == "WARNING"]
    assert len(lines) == 1 and "engine is gone" in lines[0].getMessage(), [r.getMessage() for r in lines]


def test_a_replica_whose_engine_is_gone_refuses_a_name_it_does_not_hold_as_engine_dead_not_as_the_registry_away(replica, service, folders) -> None:
    """A request for a registered name this replica does not hold makes it sync (Serve's loader); with
    its engine gone that sync fails with EngineDeadError, and the request was refused with
    adapter_unavailable, "this replica does not hold it and cannot reach the registry": the registry
    was fine. Now it is refused as every other request there is, engine_dead, naming the engine."""
    record(replica, service, "A", folders.v1)
    sync(replica)
    record(replica, service, "B", folders.v1)  # registered since; this replica does not hold it
    replica.engine.shutdown()
    got = items(replica, "B")
    assert [i[:2] for i in got] == [("error", "engine_dead")], got
    assert "registry" not in got[0][2] and "shut down" in got[0][2], got


@pytest.mark.parametrize("how", ["shut down", "step failed"])
def test_a_replica_whose_engine_is_gone_refuses_requests_without_asking_the_registry(replica, service, folders, how) -> None:
    """A request behind the ingress's revision, or for a name the replica does not hold, made a
    replica whose engine was gone sync first: one or two registry round trips per request (a
    shut-down engine never completes an apply, so every request stayed behind), and then, for a
    version it did not hold, an adapter_unavailable "has not caught up (its sync failed:
    EngineDeadError ...)" instead of the engine_dead every other request there got (after a failed
    step: a 404 for a name not registered). Now every adapter request there is refused at once with
    engine_dead and the engine's own message, the registry untouched."""
    record(replica, service, "A", folders.v1)
    sync(replica)
    v1 = version_of(folders.v1, replica)
    revision = record(replica, service, "B", folders.v1)["revision"]  # the ingress knows it; the replica has not applied it
    if how == "shut down":
        replica.engine.shutdown()
    else:
        replica.engine.dead_error = "engine step failed: RuntimeError: boom"  # what AsyncLLMEngine._die sets
    asked = RecordingHandle(service)
    replica.registry = asked
    cases = [("A", {}), ("A", {"expected_version": v1}), ("A", {"expected_version": "f" * 64}), ("B", {}),
             ("B", {"expected_version": v1}), ("not-registered", {})]
    answers = [items(replica, name, min_revision=revision, **kwargs) for name, kwargs in cases]
    assert asked.made == 0, [name for name, _ in asked.replies]
    message = replica.engine.dead_error
    assert all(a == [("error", "engine_dead", message)] for a in answers), list(zip(cases, answers))


def test_a_replica_whose_step_failed_applies_no_adapter_change(replica, service, folders) -> None:
    """A replica whose step failed (Serve about to replace it) applied the registry's changes into
    its dead engine, as a single server's admin route installed a load there with a 200; the engine
    now refuses adapter changes once dead, so its sync ends with EngineDeadError (the sync loop then
    stops with one WARNING, as for a shut-down engine) and its set stays as it was."""
    from runtime.async_engine import EngineDeadError

    record(replica, service, "A", folders.v1)
    sync(replica)
    record(replica, service, "B", folders.v1)
    replica.engine.dead_error = "engine step failed: RuntimeError: boom"  # what AsyncLLMEngine._die sets
    with pytest.raises(EngineDeadError, match="boom"):
        sync(replica)
    assert [a.name for a in replica.engine.adapters()] == ["A"]


def test_a_failing_sync_before_requests_is_logged_once_per_kind_and_its_end_once(replica, service, folders, caplog) -> None:
    """While the registry is away, every request behind the ingress's revision logged a WARNING of
    its own; now one line per kind of failure, and one INFO line once such a sync works again."""
    import ray

    record(replica, service, "A", folders.v1)
    sync(replica)
    revision = record(replica, service, "B", folders.v1)["revision"]
    replica.registry = LocalHandle(FlakyRegistry(service, failures=3, error=ray.exceptions.RayActorError()))
    with caplog.at_level("DEBUG", logger="lorafleet"):
        answers = [items(replica, "A", min_revision=revision, max_tokens=1) for _ in range(4)]
    assert all(a[-1][0] == "out" for a in answers), answers  # served from the set it holds, then caught up
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "lorafleet.replica" and r.levelname in ("WARNING", "INFO")]
    assert [level for level, _ in lines] == ["WARNING", "INFO"], lines
    assert "sync before a request failed (RayActorError" in lines[0][1] and "work again (3 failed)" in lines[1][1], lines


def test_check_health_fails_when_syncs_keep_failing(replica, service) -> None:
    now = [1000.0]
    replica._clock = lambda: now[0]
    sync(replica)  # a success at t=1000
    replica.registry = LocalHandle(FlakyRegistry(service, failures=10**9, error=KeyError("entries")))
    asyncio.run(run_sync_loop_until(replica, lambda: replica._sync_error is not None))
    now[0] += replica.SYNC_STALE_AFTER_S - 1
    replica.check_health()  # failing, but not for long
    now[0] += 2
    with pytest.raises(RuntimeError, match="no adapter sync succeeded .*KeyError"):
        replica.check_health()
    replica.registry = LocalHandle(service)
    sync(replica)
    replica.check_health()


def test_check_health_tolerates_the_registry_being_away(replica, service) -> None:
    """The registry restarts from its manifest; replicas keep serving meanwhile (restarting them would not help)."""
    import ray

    now = [1000.0]
    replica._clock = lambda: now[0]
    sync(replica)
    away = FlakyRegistry(service, failures=10**9, error=ray.exceptions.RayActorError())
    replica.registry = LocalHandle(away)
    asyncio.run(run_sync_loop_until(replica, lambda: replica._sync_error is not None))
    now[0] += 10 * replica.SYNC_STALE_AFTER_S  # away for long, still trying
    tries = away.calls
    asyncio.run(run_sync_loop_until(replica, lambda: away.calls > tries))
    replica.check_health()
    # Back, but syncs fail for another reason: that is counted from then on, not from before the outage.
    replica.registry = LocalHandle(FlakyRegistry(service, failures=10**9, error=KeyError("entries")))
    asyncio.run(run_sync_loop_until(replica, lambda: "KeyError" in (replica._sync_error or "")))
    replica.check_health()
    now[0] += replica.SYNC_STALE_AFTER_S + 1
    with pytest.raises(RuntimeError, match="no adapter sync succeeded"):
        replica.check_health()


# ---- 5: a greedy replay after a replica died runs on the version the request started on, or not at all --
def hot_updated(rep: LoraReplica, service: AdapterRegistryService, folders: SimpleNamespace) -> tuple[str, str]:
    """Register A at v1, then hot-update it to v2 on ``rep``; returns (v1, v2)."""
    record(rep, service, "A", folders.v1)
    sync(rep)
    record(rep, service, "A", folders.v2)
    sync(rep)
    v1, v2 = version_of(folders.v1, rep), version_of(folders.v2, rep)
    assert held(rep)["A"][0] == v2
    return v1, v2


def test_replica_refuses_a_replay_pinned_to_another_version(replica, service, folders) -> None:
    v1, v2 = hot_updated(replica, service, folders)
    refused = items(replica, "A", pinned_version=v1)
    assert [i[:2] for i in refused] == [("error", "adapter_unavailable")], refused
    assert v1 in refused[0][2] and v2 in refused[0][2], refused[0][2]
    served = items(replica, "A", pinned_version=v2)
    assert served[-1][0] == "out" and served[-1][1].adapter.version == v2, served


class Stream:
    """A replica's response stream as the ingress sees it: async-iterable, with ``cancel``."""

    def __init__(self, items: Any) -> None:
        self.items = items

    def __aiter__(self) -> Any:
        return self.items

    def cancel(self) -> None:
        pass


class ScriptedReplicas:
    """The replica deployment handle, as ReplicaSetEngine calls it: the n-th ``generate`` call
    answers with ``scripts[n](*args)``; ``calls`` keeps the arguments."""

    def __init__(self, *scripts: Any) -> None:
        self.scripts, self.calls = list(scripts), []
        self.generate = SimpleNamespace(remote=self._generate)

    def options(self, **options: Any) -> "ScriptedReplicas":
        return self

    def _generate(self, *args: Any) -> Stream:
        self.calls.append(args)
        return Stream(self.scripts[len(self.calls) - 1](*args))


def test_greedy_replay_is_refused_on_a_replica_holding_another_version(replica, service, folders, tiny_llama_dir) -> None:
    """The replica that died had served A@v1; the only live one holds A@v2 and reproduces the
    tokens sent so far. Continuing there would append v2 tokens to a v1 prefix."""
    import ray

    from runtime.distributed.replica_set import ReplicaSetEngine, ReplicaUnavailable

    v1, v2 = hot_updated(replica, service, folders)
    on_v2 = [i[1] for i in items(replica, "A", max_tokens=6)]
    sent_on_v1 = [dataclasses.replace(out, adapter=AdapterRef("A", v1)) for out in on_v2[:2]]

    async def died_after_two_tokens(*args: Any) -> Any:
        for out in sent_on_v1:
            yield ("out", out, None)
        raise ray.exceptions.RayActorError()

    replicas = ScriptedReplicas(died_after_two_tokens, replica.generate)
    ingress = ReplicaSetEngine(replicas, None, str(tiny_llama_dir), "tiny", 64)

    async def run() -> list[Any]:
        got: list[Any] = []
        with pytest.raises(ReplicaUnavailable) as refused:
            async for delta in ingress.generate("req", "hello there", SamplingParams(max_tokens=6, ignore_eos=True), "A"):
                got.append(delta)
        assert refused.value.status == 503 and "retry" in refused.value.message, refused.value.message
        return got

    got = asyncio.run(run())
    assert [d.adapter for d in got] == [AdapterRef("A", v1)] * 2, f"tokens of another version were passed on: {got}"
    assert len(replicas.calls) == 2


# ---- 6: a replica behind the ingress's revision syncs before it serves an adapter ------------------
def test_replica_behind_the_ingress_syncs_before_serving_a_name_it_already_holds(replica, service, folders) -> None:
    """After an admin call returned, a replica that was not live then still holds A@v1 and Serve's
    multiplexed cache still holds its lease on A, so the loader (``_lease``) is not called."""
    record(replica, service, "A", folders.v1)
    sync(replica)
    revision = record(replica, service, "A", folders.v2)["revision"]

    async def cached_lease(name: str) -> Any:  # what Serve's cache answers for a name it holds
        return SimpleNamespace(name=name)

    replica.load_adapter = cached_lease
    served = items(replica, "A", min_revision=revision)
    assert served[-1][0] == "out", served
    assert served[-1][1].adapter.version == version_of(folders.v2, replica), "served the version the registry replaced"
    assert replica.applied_revision == revision


def test_a_replica_that_cannot_catch_up_does_not_serve_the_version_the_registry_replaced(replica, service, folders, tiny_llama_dir) -> None:
    """A replica holding A@v1 missed the hot update to v2, and its sync before the request fails
    (the registry actor is restarting): it served v1 as if current. Now it refuses A (503
    adapter_unavailable, retry) and still serves B, whose version it holds is the current one."""
    import ray

    from runtime.distributed.replica_set import ReplicaSetEngine

    record(replica, service, "A", folders.v1)
    record(replica, service, "B", folders.v1)
    sync(replica)
    record(replica, service, "A", folders.v2)
    replica.registry = LocalHandle(FlakyRegistry(service, failures=10**9, error=ray.exceptions.RayActorError()))
    ingress = ReplicaSetEngine(ScriptedReplicas(replica.generate, replica.generate), None, str(tiny_llama_dir), "tiny", 64)
    ingress._take(service.view())

    async def run(adapter: str) -> list[Any]:
        return [d async for d in ingress.generate(f"req-{adapter}", "hello there", SamplingParams(max_tokens=2), adapter)]

    with pytest.raises(APIError) as refused:
        served = asyncio.run(run("A"))
        pytest.fail(f"served A@{served[-1].adapter.version}; the registry names {version_of(folders.v2, replica)}")
    assert (refused.value.status, refused.value.code) == (503, "adapter_unavailable") and "retry" in refused.value.message, refused.value.message
    assert asyncio.run(run("B"))[-1].adapter == AdapterRef("B", version_of(folders.v1, replica))


def test_a_replica_that_cannot_reach_the_registry_refuses_a_name_it_cannot_serve_instead_of_seeming_dead(replica, service, folders,
                                                                                                          tiny_llama_dir) -> None:  # fmt: skip
    """A's update failed here, so the replica does not serve A; a request for A made it sync, and with
    the registry away that sync's RayActorError escaped ``generate``: the ingress took it for this
    replica's death, sent the request again, and answered 503 replica_unavailable ("died")."""
    import ray

    from runtime.distributed.replica_set import ReplicaSetEngine

    record(replica, service, "A", folders.v1)
    sync(replica)
    record(replica, service, "A", folders.v2)
    folders.v2.rename(folders.root / "v2-not-yet-visible")
    sync(replica)  # A@v2 failed: A is not served here
    replica.registry = LocalHandle(FlakyRegistry(service, failures=10**9, error=ray.exceptions.RayActorError()))
    replicas = ScriptedReplicas(replica.generate, replica.generate)
    ingress = ReplicaSetEngine(replicas, None, str(tiny_llama_dir), "tiny", 64)
    ingress._take(service.view())

    async def run() -> None:
        async for _ in ingress.generate("req", "hello there", SamplingParams(max_tokens=2), "A"):
            pass

    with pytest.raises(APIError) as refused:
        asyncio.run(run())
    assert (refused.value.status, refused.value.code) == (503, "adapter_unavailable"), refused.value.message
    assert len(replicas.calls) == 1, "retried as if the replica had died"


# ---- 7: a registry restarted at a lower revision (its manifest lost or deleted) -----------------------
def test_the_ingress_follows_a_registry_restarted_at_a_lower_revision_and_never_steps_back_within_one(service, tiny_llama_dir, tmp_path) -> None:
    """A registry actor restarted from a lost (or deleted) manifest starts again at revision 0: the
    ingress dropped its views as older than the revision it held (5), so the adapters registered
    after the restart, hot updates included, never reached routing. Revisions are now compared
    within one registry actor only; a late reply of the registry left is still never taken."""
    from runtime.distributed.replica_set import ReplicaSetEngine

    for i in range(5):
        service.register("A", f"/adapters/a{i}", f"{i + 1:064x}", 8)
    handle = LocalHandle(service)
    ingress = ReplicaSetEngine(None, handle, str(tiny_llama_dir), "tiny", 64)
    asyncio.run(ingress.refresh())
    assert (ingress._view["revision"], ingress._current_version("A")) == (5, f"{5:064x}")
    late_reply_of_the_old_registry = service.view()
    restarted = AdapterRegistryService(str(tmp_path / "manifest-lost"))
    restarted.register("A", "/adapters/a-new", f"{9:064x}", 8)
    handle.target = restarted
    asyncio.run(ingress.refresh())
    assert (ingress._view["revision"], ingress._current_version("A")) == (1, f"{9:064x}"), "the restarted registry's set is not routed"
    restarted.register("B", "/adapters/b", f"{2:064x}", 8)
    stale_within_the_new_registry = restarted.view()
    restarted.register("A", "/adapters/a-newer", f"{10:064x}", 8)  # a hot update after the restart
    asyncio.run(ingress.refresh())
    assert (ingress._view["revision"], ingress._current_version("A")) == (3, f"{10:064x}")
    ingress._take(stale_within_the_new_registry)
    ingress._take(late_reply_of_the_old_registry)
    assert (ingress._view["revision"], ingress._current_version("A"), ingress._view["registry"]) == (3, f"{10:064x}", restarted.incarnation)


def test_the_ingress_remembers_only_the_last_registries_it_left_and_still_refuses_their_late_replies(tiny_llama_dir) -> None:
    """The ingress kept the id of every registry incarnation it left, one per registry restart, for
    ever. Now it keeps the last LEFT_REGISTRIES_KEPT, and still refuses a late reply of each of those."""
    from runtime.distributed.replica_set import ReplicaSetEngine

    ingress = ReplicaSetEngine(None, None, str(tiny_llama_dir), "tiny", 64)
    kept = ingress.LEFT_REGISTRIES_KEPT

    def view(incarnation: int, revision: int = 0) -> dict[str, Any]:
        entry = {"name": "A", "path": f"/a{incarnation}", "version": f"{incarnation + 1:064x}", "max_rank": 8, "registered_at": 1.0}
        return {"registry": f"registry-{incarnation}", "revision": revision, "entries": [entry], "ready": True}

    restarts = kept + 5
    late_replies = [view(i, revision=99) for i in range(restarts)]  # each sent just before its registry died
    for i in range(restarts + 1):
        ingress._take(view(i))
    assert ingress._view["registry"] == f"registry-{restarts}"
    assert len(ingress._left_registries) == kept, f"{len(ingress._left_registries)} registries left are kept"
    for late in late_replies[-kept:]:
        ingress._take(late)
    assert (ingress._view["registry"], ingress._current_version("A")) == (f"registry-{restarts}", f"{restarts + 1:064x}"), "a late reply was taken"


def test_a_replica_follows_a_registry_restarted_at_a_lower_revision_and_never_serves_the_replaced_version(replica, service, folders, tiny_llama_dir,
                                                                                                          tmp_path) -> None:  # fmt: skip
    """A replica at revision 3 of the registry before the restart counted as having applied revision
    1 of the restarted one (3 >= 1): it was sent no state, the admin call's wait saw it done, and it
    served A@v1, which the restarted registry had replaced by v2, for as long as that registry's
    revision stayed at or below 3. Now revisions of another registry actor count as nothing applied."""
    import ray

    from runtime.distributed.replica_set import ReplicaSetEngine

    record(replica, service, "A", folders.v1)
    record(replica, service, "B", folders.v1)
    record(replica, service, "C", folders.v1)
    sync(replica)
    assert replica.applied_revision == 3
    restarted = AdapterRegistryService(str(tmp_path / "manifest-lost"))
    revision = record(replica, restarted, "A", folders.v2)["revision"]
    assert revision == 1
    v1, v2 = version_of(folders.v1, replica), version_of(folders.v2, replica)
    # The replica's next heartbeat reaches the restarted registry: it is behind, and an admin call waits for it.
    replica.registry = LocalHandle(restarted)
    assert asyncio.run(replica._heartbeat()) == restarted.state(), "the replica is not sent the restarted registry's set"
    assert asyncio.run(restarted.wait_applied(revision, timeout_s=0.0))["lagging"] == ["replica-1"]
    # A request routed with the restarted registry's view, before the replica applied its set: it syncs first.
    ingress = ReplicaSetEngine(ScriptedReplicas(replica.generate, replica.generate), LocalHandle(restarted), str(tiny_llama_dir), "tiny", 64)
    asyncio.run(ingress.refresh())

    async def run(adapter: str) -> list[Any]:
        return [d async for d in ingress.generate(f"req-{adapter}", "hello there", SamplingParams(max_tokens=2), adapter)]

    assert asyncio.run(run("A"))[-1].adapter == AdapterRef("A", v2)
    assert held(replica) == {"A": (v2, str(folders.v2))}, "B and C, which the restarted registry does not know, are still served"
    assert replica.applied_revision == revision and replica.registry_id == restarted.incarnation
    assert asyncio.run(restarted.wait_applied(revision, timeout_s=0.0))["applied"] == ["replica-1"]
    # Another restart, and the replica cannot reach it: it holds a version the new registry replaced, so it refuses.
    again = AdapterRegistryService(str(tmp_path / "manifest-lost-again"))
    record(replica, again, "A", folders.v1)
    replica.registry = LocalHandle(FlakyRegistry(again, failures=10**9, error=ray.exceptions.RayActorError()))
    ingress.registry = LocalHandle(again)
    asyncio.run(ingress.refresh())
    with pytest.raises(APIError) as refused:
        served = asyncio.run(run("A"))
        pytest.fail(f"served A@{served[-1].adapter.version}; the registry names {v1}")
    assert (refused.value.status, refused.value.code) == (503, "adapter_unavailable"), refused.value.message


def test_ingress_sends_the_registry_revision_it_knows(tiny_llama_dir) -> None:
    from runtime.distributed.replica_set import ReplicaSetEngine

    async def nothing(*args: Any) -> Any:
        return
        yield

    replicas = ScriptedReplicas(nothing)
    ingress = ReplicaSetEngine(replicas, None, str(tiny_llama_dir), "tiny", 64)
    ingress._take({"revision": 7, "entries": [], "replicas": {}})

    async def run() -> None:
        async for _ in ingress.generate("req", "hello", SamplingParams(max_tokens=2), "A"):
            pass

    asyncio.run(run())
    assert replicas.calls[0][5] == 7, replicas.calls  # (request_id, prompt, params, adapter, pinned_version, revision, version)


def test_ingress_pins_a_group_of_requests_to_one_adapter_version(tiny_llama_dir) -> None:
    """The choices of one HTTP request go to replicas separately: each is pinned to the version
    its group saw first, even when the ingress's view moves on between them (a replica holding
    another version then refuses it, 503 adapter_unavailable, rather than mixing versions)."""
    from runtime.distributed.replica_set import ReplicaSetEngine

    async def nothing(*args: Any) -> Any:
        return
        yield

    replicas = ScriptedReplicas(nothing, nothing, nothing)
    ingress = ReplicaSetEngine(replicas, None, str(tiny_llama_dir), "tiny", 64)
    entry = {"name": "A", "path": "/a", "version": "1" * 64, "max_rank": 8, "registered_at": 1.0}
    ingress._take({"revision": 1, "entries": [entry], "replicas": {}})
    group = ingress.admission_group(2)

    async def run(request_id: str, **kwargs: Any) -> None:
        async for _ in ingress.generate(request_id, "hello", SamplingParams(max_tokens=2), "A", **kwargs):
            pass

    asyncio.run(run("g-0", group=group))
    ingress._take({"revision": 2, "entries": [{**entry, "version": "2" * 64}], "replicas": {}})  # a hot reload reached the view
    asyncio.run(run("g-1", group=group))
    asyncio.run(run("alone"))
    pinned = [call[4] for call in replicas.calls]  # (request_id, prompt, params, adapter, pinned_version, revision)
    assert pinned == ["1" * 64, "1" * 64, None]
    with pytest.raises(ValueError, match="more than its 2 requests"):
        asyncio.run(run("g-2", group=group))


def test_an_unchanged_refresh_reply_never_overwrites_the_newer_view_an_admin_call_installed(service, tiny_llama_dir) -> None:
    """The refresh (event loop) and an admin call (worker thread) both take views. _take read the
    view held (revision R), compared, and wrote it back with the reply's "ready"; an admin call's
    R+1 view installed between the read and the write was overwritten, and routing went back to R
    until the next refresh. The interleaving is made by hand: the admin call's _take runs in a
    thread at the refresh's first read of the held view, and the refresh goes on once that call
    finished or waits for the view's lock (a stand-in that says when it is contended)."""
    from runtime.distributed.replica_set import ReplicaSetEngine

    ingress = ReplicaSetEngine(None, LocalHandle(service), str(tiny_llama_dir), "tiny", 64)
    service.register("A", "/adapters/a1", "1" * 64, 8)
    asyncio.run(ingress.refresh())
    unchanged = service.view(ingress._known())
    assert unchanged["entries"] is None and unchanged["revision"] == 1
    service.register("A", "/adapters/a2", "2" * 64, 8)  # the admin call's load: revision 2
    admin_view = service.view(ingress._known())
    admin_may_go_on = threading.Event()  # the admin call's _take finished, or waits for the lock

    class ContendedLock:
        def __init__(self) -> None:
            self.lock = threading.Lock()

        def __enter__(self) -> None:
            if not self.lock.acquire(blocking=False):
                admin_may_go_on.set()
                self.lock.acquire()

        def __exit__(self, *exc: Any) -> None:
            self.lock.release()

    def admin_take() -> None:
        ingress._take(admin_view)
        admin_may_go_on.set()

    admin = threading.Thread(target=admin_take)

    class HeldView(dict):
        def get(self, key: Any, default: Any = None) -> Any:
            if admin.ident is None:  # the refresh's first read of the view held: the admin call's _take runs now
                admin.start()
                assert admin_may_go_on.wait(30), "the admin call's _take neither finished nor waited for the lock"
            return super().get(key, default)

    ingress._view_lock = ContendedLock()
    ingress._view = HeldView(ingress._view)
    ingress._take(unchanged)  # the refresh's reply for revision 1
    admin.join(30)
    assert (ingress._view["revision"], ingress._current_version("A")) == (2, "2" * 64), "the refresh's unchanged reply stepped routing back"


def test_ingress_lists_each_adapter_with_its_registration_time(tiny_llama_dir) -> None:
    """/v1/models dates an adapter's card by its registration; the ingress takes it from the registry's view."""
    from runtime.distributed.replica_set import ReplicaSetEngine

    ingress = ReplicaSetEngine(ScriptedReplicas(), None, str(tiny_llama_dir), "tiny", 64)
    entry = {"name": "A", "path": "/adapters/a", "version": "v" * 64, "max_rank": 8, "registered_at": 1_700_000_000.5}
    ingress._take({"revision": 3, "entries": [entry], "replicas": {}})
    [info] = ingress.adapters()
    assert (info.name, info.max_rank, info.registered_at) == ("A", 8, 1_700_000_000.5)


def test_ingress_builds_the_adapter_list_once_per_registry_view_not_per_request(tiny_llama_dir, monkeypatch) -> None:
    """Every request resolves its model through ``adapters()``; the ingress built an AdapterInfo per
    registered adapter each time (2 ms of its one event loop per request with 2000 adapters)."""
    from runtime.distributed import replica_set
    from runtime.distributed.replica_set import ReplicaSetEngine

    ingress = ReplicaSetEngine(ScriptedReplicas(), None, str(tiny_llama_dir), "tiny", 64)
    entries = [{"name": f"a{i}", "path": f"/adapters/a{i}", "version": f"{i:064x}", "max_rank": 8, "registered_at": 1.0} for i in range(50)]
    ingress._take({"revision": 3, "entries": entries, "replicas": {}})
    built: list[str] = []
    real = replica_set.AdapterInfo
    monkeypatch.setattr(replica_set, "AdapterInfo", lambda *args: built.append(args[0]) or real(*args))
    for _ in range(3):
        assert [(a.name, a.version) for a in ingress.adapters()] == [(e["name"], e["version"]) for e in entries]
    assert built == [], f"{len(built)} AdapterInfo built for 3 requests"
    ingress._take({"revision": 4, "entries": entries[:1], "replicas": {}})
    assert [a.name for a in ingress.adapters()] == ["a0"] and ingress._current_version("a1") is None


def map_entries(report: dict[str, Any]) -> int:
    """Per-adapter entries a heartbeat's report carries: whole maps, or their changes and removals."""
    total = 0
    for key in ("adapters", "registered"):
        value = report.get(key, {})
        total += len(value["changed"]) + len(value["removed"]) if set(value) == {"changed", "removed"} else len(value)
    return total


def test_heartbeats_carry_only_the_adapters_that_changed(replica, service, folders, tmp_path) -> None:
    """Every heartbeat (4 a second per replica) carried every registered adapter's counters and
    version, whether anything changed or not: the registry's load grew as adapters x replicas.
    Now only changed entries travel, and the registry still holds the whole report."""
    import pickle

    names = [f"n{i}" for i in range(6)]
    for name in names:
        record(replica, service, name, folders.v1)
    sync(replica)
    sent: list[tuple[int, int]] = []  # (entries, pickled bytes) per heartbeat
    real = service.heartbeat

    def heartbeat(*args: Any) -> Any:
        sent.append((map_entries(args[2]), len(pickle.dumps(args[2]))))
        return real(*args)

    service.heartbeat = heartbeat  # type: ignore[method-assign]

    def beat() -> tuple[int, int]:
        sent.clear()
        asyncio.run(replica._heartbeat())
        held_now = service.replicas["replica-1"].snapshot
        whole = replica.report()
        assert (held_now["adapters"], held_now["registered"]) == (whole["adapters"], whole["registered"]), "the registry's report differs from the replica's"
        return sent[-1]

    whole_entries = len(replica.report()["adapters"]) + len(replica.report()["registered"])
    assert whole_entries >= len(names) * 2
    idle = [beat() for _ in range(3)]
    assert [entries for entries, _ in idle] == [0, 0, 0], f"idle heartbeats carried {idle} (entries, bytes); the whole maps have {whole_entries} entries"
    items(replica, "n3")
    entries, _ = beat()
    assert entries == 1, f"after one request for n3, a heartbeat carried {entries} entries"
    service.unregister("n5")
    sync(replica)
    assert "n5" not in service.replicas["replica-1"].snapshot["registered"]
    # A restarted registry holds no report of this replica: the changes are refused and the whole report follows.
    restarted = AdapterRegistryService(service.folder())
    replica.registry = LocalHandle(restarted)
    asyncio.run(replica._heartbeat())
    assert restarted.replicas["replica-1"].snapshot["registered"] == replica.report()["registered"]
    assert restarted.replicas["replica-1"].snapshot["adapters"] == replica.report()["adapters"]


def adapter_series(page: str) -> list[str]:
    return sorted(line for line in page.splitlines() if line.startswith("lorafleet_adapter_") and 'adapter="' in line)


def ray_get_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ingress's blocking ``ray.get`` (admin calls, /metrics' snapshot fetch) runs a ``LocalHandle`` call."""
    from runtime.distributed import replica_set

    monkeypatch.setattr(replica_set, "ray", SimpleNamespace(get=lambda ref, timeout=None: asyncio.run(ref), exceptions=replica_set.ray.exceptions))


def test_a_replica_folds_the_counters_of_unloaded_adapters_past_the_metrics_cap(replica, service, folders, tiny_llama_dir, monkeypatch) -> None:
    """/metrics at the ingress was bounded (adapters past the cap share __other__), but a replica's
    engine was never told to fold, as a single server's is: it kept counters, and sent them to the
    registry and the ingress, for every adapter it ever served. Now the ingress's scrape relays the
    names through the registry (with its next refresh), the replica folds them at its next
    heartbeat, and the page is unchanged."""
    from runtime.distributed.ingress import build_app
    from runtime.distributed.replica_set import ReplicaSetEngine
    from runtime.server.options import ServerOptions

    ray_get_locally(monkeypatch)

    names = [f"n{i}" for i in range(4)]
    for name in names:
        record(replica, service, name, folders.v1)
    sync(replica)
    for name in names:
        items(replica, name, max_tokens=1)
    for name in names[1:]:
        service.unregister(name)
    sync(replica)
    assert set(names) <= set(replica.report()["adapters"])
    ingress = ReplicaSetEngine(None, LocalHandle(service), str(tiny_llama_dir), "tiny", 64)
    app = build_app(ingress, ServerOptions(metrics_max_adapters=1))
    asyncio.run(ingress.refresh())
    before = app.state.lorafleet.metrics.render().decode()
    assert 'adapter="n0"' in before and 'adapter="__other__"' in before and 'adapter="n1"' not in before
    asyncio.run(ingress.refresh())  # sends what the scrape asked for
    asyncio.run(replica._heartbeat())  # the reply asks the replica to fold what the scrape counted under __other__
    kept = set(replica.report()["adapters"])
    assert kept.isdisjoint(names[1:]), f"the replica still keeps counters of unloaded adapters past the cap: {sorted(kept)}"
    assert "__other__" in kept and "n0" in kept
    asyncio.run(replica._heartbeat())
    assert set(service.replicas["replica-1"].snapshot["adapters"]) == kept
    after = app.state.lorafleet.metrics.render().decode()
    assert adapter_series(after) == adapter_series(before)


class RecordingHandle(LocalHandle):
    """A ``LocalHandle`` that keeps every call: (method, reply) once answered, and how many calls
    were made and how many of their results were read (awaited, or ``ray.get``)."""

    def __init__(self, target: Any) -> None:
        super().__init__(target)
        self.replies: list[tuple[str, Any]] = []
        self.made = self.read = 0

    def __getattr__(self, name: str) -> Any:
        call = super().__getattr__(name).remote
        handle = self

        def remote(*args: Any, **kwargs: Any) -> Any:
            handle.made += 1

            async def answered() -> Any:
                handle.read += 1
                reply = await call(*args, **kwargs)
                handle.replies.append((name, reply))
                return reply

            return answered()

        return SimpleNamespace(remote=remote)


def adapter_entries(reply: dict[str, Any]) -> int:
    """Per-adapter entries a registry view carries: registry entries, and replicas' snapshot map entries."""
    return len(reply.get("entries") or []) + sum(map_entries(r.get("snapshot", {})) for r in reply.get("replicas", {}).values())


def test_an_idle_ingress_refresh_carries_no_adapter_entry(service, tiny_llama_dir, monkeypatch) -> None:
    """The ingress's refresh (twice a second) pulled every registered entry and every live replica's
    whole snapshot, adapters x replicas entries with nothing changing. Now an idle refresh carries
    none: the set travels when its revision (or the registry actor) changed, the snapshots when
    /metrics is scraped; what requests are routed with (the revision, each adapter's version, ready)
    is as fresh as before."""
    import pickle

    from runtime.distributed.replica_set import STARTING, ReplicaSetEngine

    ray_get_locally(monkeypatch)
    names = [f"n{i:02d}" for i in range(20)]
    for name in names:
        service.register(name, f"/adapters/{name}", f"{1:064x}", 8)

    def report(requests: int) -> dict[str, Any]:
        return {"running": 0, "adapters": {n: {"requests": requests, "loads": 1} for n in names}, "registered": {n: f"{1:064x}" for n in names}}

    for rid in ("r1", "r2", "r3"):
        service.heartbeat(rid, service.manifest.revision, report(1))
    handle = RecordingHandle(service)
    ingress = ReplicaSetEngine(None, handle, str(tiny_llama_dir), "tiny", 64)

    def refresh() -> tuple[int, int]:
        """(adapter entries, pickled bytes) of the refresh's view reply."""
        handle.replies.clear()
        asyncio.run(ingress.refresh())
        [(method, reply)] = handle.replies
        assert method == "view"
        return adapter_entries(reply), len(pickle.dumps(reply))

    first, _ = refresh()
    assert first >= len(names) and [a.name for a in ingress.adapters()] == names
    idle = [refresh() for _ in range(3)]
    assert [entries for entries, _ in idle] == [0, 0, 0], f"idle refreshes carried {idle} (entries, bytes)"
    assert all(size < 300 for _, size in idle), idle
    assert [a.name for a in ingress.adapters()] == names
    # A change travels with the next refresh: a hot update's version is what requests are pinned to.
    revision = service.register("n03", "/adapters/n03-v2", f"{2:064x}", 8)["revision"]
    assert refresh()[0] == len(names)
    assert ingress._view["revision"] == revision and ingress._current_version("n03") == f"{2:064x}"
    assert refresh()[0] == 0
    service.set_ready(False)  # no new revision: still taken
    refresh()
    assert ingress.dead_error == STARTING
    service.set_ready(True)
    refresh()
    assert ingress.dead_error is None
    # A restarted registry actor (same manifest) sends the set whole once.
    handle.target = AdapterRegistryService(service.folder())
    assert refresh()[0] == len(names) and refresh()[0] == 0
    assert [(a.name, a.version) for a in ingress.adapters()] == [(n, f"{2 if n == 'n03' else 1:064x}") for n in names]
    # The snapshots come when /metrics asks for them.
    handle.target = service
    service.heartbeat("r1", service.manifest.revision, report(5))
    snaps = ingress.replica_snapshots()
    assert sorted(snaps) == ["r1", "r2", "r3"] and snaps["r1"]["adapters"]["n00"]["requests"] == 5 and snaps["r2"] == report(1), snaps


def test_a_scrape_keeps_a_replica_s_last_snapshot_while_a_restarted_registry_waits_for_its_whole_report(service, tiny_llama_dir, monkeypatch) -> None:
    """A restarted registry refuses a replica's first change-only report, and the whole report comes
    in the replica's next call. A view taken in between showed that replica with an empty snapshot,
    which /metrics rendered as its counters going back to 0 (a counter reset for Prometheus)."""
    from runtime.distributed.replica_set import ReplicaSetEngine

    ray_get_locally(monkeypatch)
    service.register("A", "/adapters/a", f"{1:064x}", 8)
    revision = service.manifest.revision
    whole = {"running": 0, "adapters": {"A": {"requests": 7, "loads": 1}}, "registered": {"A": f"{1:064x}"}}
    number = service.heartbeat("r1", revision, whole)["report"]
    handle = LocalHandle(service)
    ingress = ReplicaSetEngine(None, handle, str(tiny_llama_dir), "tiny", 64)
    asyncio.run(ingress.refresh())
    assert ingress.replica_snapshots() == {"r1": whole}
    restarted = AdapterRegistryService(service.folder())
    handle.target = restarted
    changes = {"running": 0, "adapters": {"changed": {"A": {"requests": 8, "loads": 1}}, "removed": []}, "registered": {"changed": {}, "removed": []}}
    assert restarted.heartbeat("r1", revision, changes, (), revision, number)["report"] is None  # refused: the whole report follows
    asyncio.run(ingress.refresh())
    assert ingress.replica_snapshots() == {"r1": whole}, "the replica's counters went back to 0 between its two calls"
    newer = {**whole, "adapters": {"A": {"requests": 8, "loads": 1}}}
    restarted.heartbeat("r1", revision, newer)
    asyncio.run(ingress.refresh())
    assert ingress.replica_snapshots() == {"r1": newer}


def test_live_replicas_says_no_report_yet_and_the_affinity_benchmark_waits_for_it(service, monkeypatch) -> None:
    """``live_replicas`` showed ``{}`` for a replica whose report a restarted registry did not hold
    yet (its change-only report refused, the whole one on its way); the affinity benchmark summed
    that as the replica's counters being 0, and its phase delta (after - before) came out wrong."""
    import ray

    from benchmarks.ray_affinity import pool_counters

    report = {"running": 0, "adapters": {"A": {"loads": 3, "device_loads": 2}}, "registered": {}}
    number = service.heartbeat("r1", 0, report)["report"]
    restarted = AdapterRegistryService(service.folder())
    changes = {"running": 0, "adapters": {"changed": {}, "removed": []}, "registered": {"changed": {}, "removed": []}}
    assert restarted.heartbeat("r1", 0, changes, (), 0, number)["report"] is None  # refused: the whole report follows
    assert restarted.live_replicas()["r1"]["snapshot"] is None
    calls = [0]

    def live_replicas() -> Any:
        calls[0] += 1
        if calls[0] == 2:  # the replica's whole report arrives
            restarted.heartbeat("r1", 0, report)
        return restarted.live_replicas()

    monkeypatch.setattr(ray, "get", lambda ref: ref)
    registry = SimpleNamespace(live_replicas=SimpleNamespace(remote=live_replicas))
    assert pool_counters(registry, poll_s=0.0) == {"loads": 3, "device_loads": 2, "host_evictions": 0}
    restarted.heartbeat("r2", 0, changes, (), 0, 1)  # refused, and its whole report never comes
    with pytest.raises(RuntimeError, match=r"no report of replica\(s\) \['r2'\]"):
        pool_counters(SimpleNamespace(live_replicas=SimpleNamespace(remote=restarted.live_replicas)), wait_s=0.0)


def test_a_scrape_that_the_registry_does_not_answer_in_time_shows_the_last_snapshots(tiny_llama_dir, monkeypatch) -> None:
    """The snapshot fetch waits ``SNAPSHOT_TIMEOUT_S`` (the registry may be restarting): the scrape
    then shows the snapshots fetched last, and the next one waits for the same call (its reply is
    read, and calls do not pile up on a registry that is slow to answer)."""
    from ray.exceptions import GetTimeoutError

    from runtime.distributed import replica_set
    from runtime.distributed.replica_set import ReplicaSetEngine

    answers = [{"r1": {"running": 1}}, {"r1": {"running": 2}}]
    fetches: list[int] = []
    registry = SimpleNamespace(replica_snapshots=SimpleNamespace(remote=lambda: fetches.append(len(fetches)) or len(fetches) - 1))
    late = [False, True, False]  # the second fetch is not answered in time at the first try

    def get(ref: int, timeout: float | None = None) -> Any:
        assert timeout == ReplicaSetEngine.SNAPSHOT_TIMEOUT_S
        if late.pop(0):
            raise GetTimeoutError("late")
        return answers[ref]

    monkeypatch.setattr(replica_set, "ray", SimpleNamespace(get=get, exceptions=replica_set.ray.exceptions))
    ingress = ReplicaSetEngine(None, registry, str(tiny_llama_dir), "tiny", 64)
    assert ingress.replica_snapshots() == {"r1": {"running": 1}}
    assert ingress.replica_snapshots() == {"r1": {"running": 1}}  # not answered in time: the last ones
    assert ingress.replica_snapshots() == {"r1": {"running": 2}} and fetches == [0, 1]


def test_a_scrape_s_fold_request_is_read_and_its_failure_logged_once(service, tiny_llama_dir, monkeypatch, caplog) -> None:
    """The scrape's fold request through the registry was fired and forgotten: when the registry's
    call failed, its error sat on a Ray reference nobody read, which Ray logs as "Unhandled error"
    when it is collected. Now the next refresh sends it and reads the reply; a failure is logged by
    lorafleet, once, and the next scrape asks again."""
    import logging

    from runtime.distributed.replica_set import ReplicaSetEngine

    ray_get_locally(monkeypatch)
    service.heartbeat("r1", service.manifest.revision, {"adapters": {"gone": {"requests": 1}}})
    handle = RecordingHandle(service)
    ingress = ReplicaSetEngine(None, handle, str(tiny_llama_dir), "tiny", 64)
    asyncio.run(ingress.refresh())
    ingress.fold_replica_adapter_counters("r1", ["gone"])  # what a scrape past the label cap does
    asyncio.run(ingress.refresh())
    assert handle.made == handle.read, f"{handle.made - handle.read} registry call(s) whose result nobody reads"
    assert service.replicas["r1"].fold == {"gone"}

    def broken(folds: Any) -> None:
        raise ValueError("no such replica table")

    service.fold_adapter_counters = broken  # type: ignore[method-assign]
    ingress.fold_replica_adapter_counters("r1", ["gone"])
    with caplog.at_level(logging.WARNING, logger="lorafleet"):
        asyncio.run(ingress.refresh())
        asyncio.run(ingress.refresh())  # nothing asked since: nothing sent, nothing logged
    assert handle.made == handle.read
    warnings = [r.getMessage() for r in caplog.records if "fold" in r.getMessage()]
    assert len(warnings) == 1 and "no such replica table" in warnings[0], warnings


async def run_refresh_loop(ingress: Any, done: Callable[[], bool]) -> None:
    """Run the ingress's refresh loop until ``done()`` (asked once per turn) or the loop ends, then stop it.
    A bound of 1000 turns, not a clock: each turn yields to the event loop once."""
    ingress.start_refresh()
    for _ in range(1000):
        if done() or ingress._refresh_task.done():
            break
        await asyncio.sleep(0)
    ingress._refresh_task.cancel()
    await asyncio.gather(ingress._refresh_task, return_exceptions=True)


def test_the_ingress_refresh_loop_goes_on_after_an_unexpected_error(service, tiny_llama_dir) -> None:
    """Only RayActorError was caught: any other error from the registry call ended the refresh task
    silently, and the ingress served a frozen adapter set from then on."""
    from runtime.distributed.replica_set import ReplicaSetEngine

    calls = [0]
    real = service.view

    def view(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyError("revision")
        return real(*args)

    service.view = view  # type: ignore[method-assign]
    ingress = ReplicaSetEngine(None, LocalHandle(service), str(tiny_llama_dir), "tiny", 64, refresh_s=0.0)
    service.register("A", "/adapters/a", f"{1:064x}", 8)

    asyncio.run(run_refresh_loop(ingress, lambda: calls[0] >= 3))
    assert calls[0] >= 3, f"the refresh loop ended after {calls[0]} call(s)"
    assert [a.name for a in ingress.adapters()] == ["A"]


def test_the_ingress_logs_a_registry_outage_once_and_its_end_once(service, tiny_llama_dir, caplog) -> None:
    """While the registry was away the refresh loop logged a warning at every tick (twice a second,
    for the whole outage). Now one line when refreshes start failing, one when they succeed again
    (with how long the outage lasted), and one more only if the kind of failure changes."""
    import logging

    import ray

    from runtime.distributed.replica_set import ReplicaSetEngine

    failures: list[Exception] = [ray.exceptions.RayActorError()] * 5 + [KeyError("revision")] * 2
    calls = [0]
    real = service.view

    def view(*args: Any) -> Any:
        calls[0] += 1
        if failures:
            raise failures.pop(0)
        return real(*args)

    service.view = view  # type: ignore[method-assign]
    ingress = ReplicaSetEngine(None, LocalHandle(service), str(tiny_llama_dir), "tiny", 64, refresh_s=0.0)
    now = [100.0]
    ingress._clock = lambda: now[0]
    service.register("A", "/adapters/a", f"{1:064x}", 8)

    def tick() -> bool:
        now[0] += 0.5
        return calls[0] >= 10

    with caplog.at_level(logging.INFO, logger="lorafleet"):
        asyncio.run(run_refresh_loop(ingress, tick))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "lorafleet.replica_set"]
    assert [level for level, _ in lines] == ["WARNING", "ERROR", "INFO"], lines
    assert "registry unavailable" in lines[0][1] and "KeyError" in lines[1][1], lines
    assert lines[2][1].startswith("registry reachable again after ") and " s" in lines[2][1], lines
    assert [a.name for a in ingress.adapters()] == ["A"]


def test_heartbeat_keeps_the_event_loop_free_while_a_step_holds_the_engine_lock(replica) -> None:
    """The heartbeat's snapshot takes the engine lock, which a step holds for its whole length:
    it must wait in a worker thread, not on the replica's event loop (which streams tokens)."""
    import threading

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with replica.engine._lock:  # noqa: SLF001 - what the step thread does for a whole step
            held.set()
            release.wait(5.0)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)

    async def run() -> bool:
        beat = asyncio.ensure_future(replica._heartbeat())
        await asyncio.sleep(0.05)  # the loop runs on while the heartbeat waits for the lock
        ran_meanwhile = not beat.done()
        release.set()
        await beat
        return ran_meanwhile

    try:
        assert asyncio.run(run()), "the heartbeat finished while the lock was held?"
    finally:
        release.set()
        holder.join(10)


def test_a_request_the_client_abandons_is_counted_as_an_abort_at_the_ingress(tiny_llama_dir) -> None:
    """The replica's own record of the abort never travels back (its stream is cancelled), so
    the ingress reports what it knows: the adapter, the prompt and the tokens it received."""
    from runtime.distributed.replica_set import ReplicaSetEngine
    from runtime.request import RequestOutput
    from runtime.server.metrics import ServerMetrics

    def out(n: int) -> RequestOutput:
        ids = tuple(range(10, 10 + n))
        return RequestOutput("req", AdapterRef("A", "v1"), ids[-1:], "x", ids, "x" * n, False, None, None, (1, 2, 3, 4, 5))

    async def three_then_running(*args: Any) -> Any:  # the replica's request goes on, but nothing more arrives
        for n in range(1, 4):
            yield ("out", on_the_wire(out(n), out(n - 1) if n > 1 else None), None)
        await asyncio.Event().wait()

    ingress = ReplicaSetEngine(ScriptedReplicas(three_then_running), None, str(tiny_llama_dir), "tiny", 64)
    seen: list[Any] = []
    ingress.add_observer(seen.append)
    metrics = ServerMetrics(lambda: {})
    ingress.add_observer(metrics.observe)

    async def run() -> None:
        stream = ingress.generate("req", "hello", SamplingParams(max_tokens=50), "A")
        async for delta in stream:
            if len(delta.token_ids) == 3:
                break
        await stream.aclose()

    asyncio.run(run())
    assert len(seen) == 1
    m = seen[0]
    assert (m.finish_reason, m.adapter, m.adapter_version, m.prompt_tokens, m.output_tokens) == ("abort", "A", "v1", 5, 3)
    assert m.ttft is None and m.queue_time is None
    text = metrics.render().decode()
    assert 'lorafleet_requests_total{adapter="A",finish_reason="abort"} 1.0' in text
    assert 'lorafleet_prompt_tokens_total{adapter="A"} 5.0' in text and 'lorafleet_generation_tokens_total{adapter="A"} 3.0' in text


def test_a_request_failed_by_its_replica_dying_is_counted_as_an_error_at_the_ingress(tiny_llama_dir) -> None:
    """A sampled request whose replica died after streaming tokens (no replay), or whose greedy
    replay died too, fails with a 503; the replica's record never comes back, so /metrics
    counted it nowhere. The ingress counts it as an error, with the tokens passed on, once."""
    import ray

    from runtime.distributed.replica_set import ReplicaSetEngine, ReplicaUnavailable
    from runtime.request import RequestOutput
    from runtime.server.metrics import ServerMetrics

    def out(n: int) -> RequestOutput:
        ids = tuple(range(10, 10 + n))
        return RequestOutput("req", AdapterRef("A", "v1"), ids[-1:], "x", ids, "x" * n, False, None, None, (1, 2, 3, 4, 5))

    async def dies_after_two(*args: Any) -> Any:
        for n in (1, 2):
            yield ("out", on_the_wire(out(n), out(n - 1) if n > 1 else None), None)
        raise ray.exceptions.RayActorError()

    async def dies_at_once(*args: Any) -> Any:
        raise ray.exceptions.RayActorError()
        yield

    metrics = ServerMetrics(lambda: {})
    seen: list[Any] = []
    for name, scripts, params in (("sampled", (dies_after_two,), SamplingParams(max_tokens=50, temperature=1.0)),
                                  ("no-output", (dies_at_once, dies_at_once), SamplingParams(max_tokens=50))):
        ingress = ReplicaSetEngine(ScriptedReplicas(*scripts), None, str(tiny_llama_dir), "tiny", 64)
        ingress.add_observer(seen.append)
        ingress.add_observer(metrics.observe)

        async def run() -> None:
            async for _ in ingress.generate(name, "hello", params, "A"):
                pass

        with pytest.raises(ReplicaUnavailable):
            asyncio.run(run())
    assert [(m.request_id, m.finish_reason, m.prompt_tokens, m.output_tokens) for m in seen] == [("sampled", "error", 5, 2), ("no-output", "error", 0, 0)]
    text = metrics.render().decode()
    assert 'lorafleet_requests_total{adapter="A",finish_reason="error"} 2.0' in text
    assert 'lorafleet_generation_tokens_total{adapter="A"} 2.0' in text and 'lorafleet_prompt_tokens_total{adapter="A"} 5.0' in text


def test_logprobs_cross_the_wire_per_step_and_survive_a_replay(replica, tiny_llama_dir) -> None:
    """A replica sends each output's new-token logprobs only (and prompt logprobs once); the
    ingress rebuilds the whole tuples, also across a greedy replay after a replica died."""
    import ray

    from runtime.distributed.replica_set import ReplicaSetEngine

    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)

    async def direct() -> Any:
        last = None
        async for out in replica.engine.generate("direct", "hello there", params, None):
            last = out
        return last

    whole = asyncio.run(direct())

    async def wire() -> list[Any]:
        return [item async for item in replica.generate("req", "hello there", params, None)]

    sent = [item[1] for item in asyncio.run(wire())]
    assert all(len(out.logprobs) == len(out.new_token_ids) for out in sent)
    assert sent[0].prompt_logprobs == whole.prompt_logprobs and all(out.prompt_logprobs is None for out in sent[1:])

    async def died_after_two_outputs(*args: Any) -> Any:
        for out in sent[:2]:
            yield ("out", out, None)
        raise ray.exceptions.RayActorError()

    async def replays(*args: Any) -> Any:
        for out in sent:
            yield ("out", out, None)

    ingress = ReplicaSetEngine(ScriptedReplicas(died_after_two_outputs, replays), None, str(tiny_llama_dir), "tiny", 64)

    async def run() -> list[Any]:
        return [delta async for delta in ingress.generate("req", "hello there", params, None)]

    got = asyncio.run(run())
    assert got[-1].token_ids == whole.token_ids and got[-1].logprobs == whole.logprobs
    assert all(d.logprobs == whole.logprobs[: len(d.token_ids)] and d.prompt_logprobs == whole.prompt_logprobs for d in got)
    assert [lp for d in got for lp in d.new_logprobs] == list(whole.logprobs)


def test_each_output_crosses_the_wire_without_what_the_previous_ones_sent(replica, tiny_llama_dir) -> None:
    """Every output went on the wire whole, prompt ids and all tokens and text so far: a stream
    cost the square of its length, and the one ingress unpickling every replica's streams spent
    ~1 ms a token on an 8k-token prompt. Now each carries only what is new; the ingress rebuilds
    the outputs the engine made."""
    from runtime.distributed.replica_set import ReplicaSetEngine

    prompt = "the quick brown fox jumps"
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)

    async def direct() -> Any:
        return [out async for out in replica.engine.generate("direct", prompt, params, None)][-1]

    whole = asyncio.run(direct())

    async def wire() -> list[Any]:
        return [item async for item in replica.generate("req", prompt, params, None)]

    sent = [item[1] for item in asyncio.run(wire())]
    assert len(sent) > 2 and sent[0].prompt_token_ids == whole.prompt_token_ids
    assert all(out.prompt_token_ids == () for out in sent[1:]), "the prompt's ids were sent with every output"
    assert all(out.token_ids == out.new_token_ids and out.text == out.new_text for out in sent), "outputs carried the tokens sent before"

    async def replays(*args: Any) -> Any:
        async for item in replica.generate("req", prompt, params, None):
            yield item

    ingress = ReplicaSetEngine(ScriptedReplicas(replays), None, str(tiny_llama_dir), "tiny", 64)

    async def run() -> list[Any]:
        return [delta async for delta in ingress.generate("req", prompt, params, None)]

    got = asyncio.run(run())
    last = got[-1]
    assert (last.token_ids, last.text, last.prompt_token_ids, tuple(last.logprobs)) == (whole.token_ids, whole.text, whole.prompt_token_ids, whole.logprobs)
    assert tuple(t for d in got for t in d.new_token_ids) == whole.token_ids and "".join(d.new_text for d in got) == whole.text
    assert all(d.prompt_token_ids == whole.prompt_token_ids for d in got)


def test_each_replica_draws_its_own_seeds_for_unseeded_requests() -> None:
    """Replicas share one config; their engine seeds must still differ, or the n unseeded
    choices of one request, spread over replicas, come back in identical pairs."""
    seeds = {replica_seed(0, f"replica-{i}") for i in range(64)}
    assert len(seeds) == 64 and all(0 <= s < 2**62 for s in seeds)
    assert replica_seed(0, "replica-1") == replica_seed(0, "replica-1") != replica_seed(1, "replica-1")


# ---- shutdown, start-up and defaults at the ingress: create_app around a ReplicaSetEngine ---------
def slow_steps(rep: LoraReplica, seconds: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each engine step of ``rep`` takes ``seconds`` longer, so tiny-model requests stay in flight."""
    import time

    step = rep.engine.engine.step

    def slow(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        time.sleep(seconds)
        return out

    monkeypatch.setattr(rep.engine.engine, "step", slow)


def test_replica_drains_its_engine_once_the_registry_says_the_application_stops(replica, service, monkeypatch) -> None:
    """SIGTERM used to delete the application at once: Serve force-killed replicas after 10 s and
    their engines never shut down, so requests in flight were cut without an error. Now the
    registry tells every replica (heartbeat) and each shuts its engine down as a single server
    does: those in flight end with a "shutdown" error (HTTP 503), new ones are refused."""
    slow_steps(replica, 0.05, monkeypatch)

    async def run() -> tuple[list[tuple], list[tuple]]:
        stream = replica.generate("long", "hello there", SamplingParams(max_tokens=50, ignore_eos=True), None)
        first = await stream.__anext__()
        service.begin_drain(0.0)  # no time left: what is in flight fails at once
        await replica._sync_once()  # the heartbeat carries the drain
        assert replica.check_health() is None, "a draining replica must not be restarted by Serve"
        rest = [item async for item in stream]
        late = [item async for item in replica.generate("late", "hello", SamplingParams(max_tokens=2), None)]
        return [first, *rest], late

    sent, late = asyncio.run(run())
    last = sent[-1][1]
    assert last.finished and last.finish_reason == "error" and last.error_kind == "shutdown", last
    assert len(last.token_ids) < 50
    assert len(late) == 1 and late[0][:2] == ("error", "engine_dead") and "shut" in late[0][2], late  # shutting down, or shut down by now
    replica._drain.join(10)
    assert replica.engine.dead_error is not None and replica.check_health() is None


def ingress_app(replicas: Any, model_dir: Path, **kwargs: Any) -> tuple[Any, Any]:
    """A ReplicaSetEngine over ``replicas`` and the app the ingress deployment builds around it."""
    from runtime.distributed.ingress import build_app
    from runtime.distributed.replica_set import ReplicaSetEngine
    from runtime.server.options import ServerOptions

    ingress = ReplicaSetEngine(replicas, None, str(model_dir), "tiny", 64, **kwargs)
    return ingress, build_app(ingress, ServerOptions())


def assert_engine_unavailable(body: dict[str, Any], fragment: str) -> None:
    err = body["error"]
    assert err["code"] == "engine_unavailable" and err["type"] == "service_unavailable" and fragment in err["message"], err


def sse_events(text: str) -> list[Any]:
    import json

    return [data if data == "[DONE]" else json.loads(data) for data in (line[6:] for line in text.splitlines() if line.startswith("data: "))]


def test_ingress_shutdown_refuses_new_requests_and_fails_those_the_drain_cuts_with_503(replica, service, tiny_llama_dir, monkeypatch) -> None:
    """What a client sees at SIGTERM: requests in flight that the replica's drain ends get a 503
    engine_unavailable (a stream: an error event, then [DONE]), not a plain-text 500 or a cut
    stream; new requests and /health get that 503 too, not Serve's plain-text 404."""
    from tests.server.conftest import client_for

    slow_steps(replica, 0.05, monkeypatch)
    ingress, app = ingress_app(ScriptedReplicas(replica.generate, replica.generate), tiny_llama_dir)
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 50, "ignore_eos": True, "temperature": 0}

    async def run() -> tuple[Any, ...]:
        async with client_for(app) as c:
            assert (await c.get("/health")).status_code == 200
            unary = asyncio.ensure_future(c.post("/v1/completions", json=body))
            streamed = asyncio.ensure_future(c.post("/v1/completions", json={**body, "stream": True}))
            for _ in range(2000):  # until both run on the replica's engine
                if ingress.active == 2 and (await asyncio.to_thread(replica.engine.snapshot))["running"] == 2:
                    break
                await asyncio.sleep(0.005)
            assert ingress.active == 2
            ingress.begin_shutdown()
            health, late = await c.get("/health"), await c.post("/v1/completions", json=body)
            service.begin_drain(0.0)
            await replica._sync_once()
            return health, late, await unary, await streamed

    health, late, unary, streamed = asyncio.run(run())
    assert health.status_code == 503 and late.status_code == 503
    assert_engine_unavailable(health.json(), "shutting down")
    assert_engine_unavailable(late.json(), "shutting down")
    assert unary.status_code == 503, unary.text
    assert_engine_unavailable(unary.json(), "shut down before the request finished")
    assert streamed.status_code == 200
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert_engine_unavailable(events[-2], "shut down before the request finished")
    assert ingress.active == 0


def test_ingress_retries_nothing_once_shutting_down(tiny_llama_dir) -> None:
    """A replica that dies during the shutdown (Serve kills what outlives its graceful timeout)
    used to be retried on a deployment with no replicas left; now the request gets its 503."""
    import ray

    holder: dict[str, Any] = {}

    async def dies_during_shutdown(*args: Any) -> Any:
        holder["ingress"].begin_shutdown()
        raise ray.exceptions.RayActorError()
        yield

    replicas = ScriptedReplicas(dies_during_shutdown)  # a retry would find no second script: IndexError
    ingress, _ = ingress_app(replicas, tiny_llama_dir)
    holder["ingress"] = ingress

    async def run() -> None:
        async for _ in ingress.generate("req", "hello", SamplingParams(max_tokens=2), None):
            pass

    with pytest.raises(APIError) as refused:
        asyncio.run(run())
    assert refused.value.status == 503 and refused.value.code == "engine_unavailable", refused.value.message
    assert len(replicas.calls) == 1 and ingress.active == 0


def test_ingress_answers_503_until_the_initial_adapters_are_registered(service, tiny_llama_dir) -> None:
    """deploy marks the registry not ready while it registers --lora-modules: /health answered
    200 and requests for those adapters 404 model_not_found meanwhile."""
    from tests.server.conftest import client_for

    async def nothing(*args: Any) -> Any:
        return
        yield

    service.set_ready(False)
    ingress, app = ingress_app(ScriptedReplicas(nothing), tiny_llama_dir)
    ingress._take(service.view())
    body = {"model": "A", "prompt": "hello", "max_tokens": 2}

    async def run() -> tuple[Any, ...]:
        async with client_for(app) as c:
            health, request, models = await c.get("/health"), await c.post("/v1/completions", json=body), await c.get("/v1/models")
            service.set_ready(True)
            ingress._take(service.view())
            return health, request, models, await c.get("/health"), await c.post("/v1/completions", json=body)

    health, request, models, later, unknown = asyncio.run(run())
    for reply in (health, request, models):
        assert reply.status_code == 503, reply.text
        assert_engine_unavailable(reply.json(), "starting")
    assert later.status_code == 200 and later.json() == {"status": "ok"}
    assert unknown.status_code == 404  # ready, and "A" is not registered: the usual answer


def test_chat_default_max_tokens_is_capped_to_the_replicas_kv_pool(service, tiny_llama_dir) -> None:
    """With a KV pool smaller than max_model_len, chat without max_tokens asked a replica for all
    of max_model_len and got a 400; a single server caps it to the pool. The replica reports its
    limit (describe), and the ingress caps the default exactly as a single server does."""
    from runtime.server.app import create_app
    from runtime.server.options import ServerOptions
    from tests.server.conftest import client_for

    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_loras=2, max_lora_rank=16,
                          max_cpu_loras=4, max_num_seqs=4, max_model_len=64, block_size=8, num_kv_blocks=4)  # fmt: skip
    engine = AsyncLLMEngine(config)
    rep = LoraReplica.__new__(LoraReplica)
    rep._setup(engine, LocalHandle(service), "replica-1", sync_interval_s=0.0)
    try:
        info = rep.describe()
        assert info["max_seq_tokens"] == 32 < info["max_model_len"] == 64
        _, app = ingress_app(ScriptedReplicas(rep.generate), tiny_llama_dir, max_seq_tokens=info["max_seq_tokens"])
        single = create_app(engine, ServerOptions())
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}

        async def run() -> tuple[Any, Any]:
            async with client_for(app) as c, client_for(single) as s:
                return await c.post("/v1/chat/completions", json=body), await s.post("/v1/chat/completions", json={**body, "model": engine.model_name})

        ray_reply, single_reply = asyncio.run(run())
    finally:
        engine.shutdown()
        rep.registry = rep.engine = None
    assert single_reply.status_code == 200, single_reply.text
    assert ray_reply.status_code == 200, ray_reply.text
    assert ray_reply.json()["usage"] == single_reply.json()["usage"]
    assert ray_reply.json()["usage"]["total_tokens"] == 32


def test_registry_tells_replicas_about_the_drain_and_the_ingress_about_readiness(service) -> None:
    assert service.view()["ready"] is True  # one that deploy did not create (a RayService's) serves at once
    assert service.heartbeat("r1", -1, {}) == {"state": service.state(), "drain_s": None, "report": 1, "fold": []}
    service.set_ready(False)
    assert service.view()["ready"] is False
    service.begin_drain(20.0)
    service.begin_drain(5.0)  # the first call sets the deadline
    reply = service.heartbeat("r1", service.state()["revision"], {})
    assert reply["state"] is None and 19.0 < reply["drain_s"] <= 20.0


def test_a_new_deploy_resets_readiness_and_the_drain_left_in_the_detached_registry(service) -> None:
    """The registry outlives applications: a start that never finished left ready False (every
    route 503 for ever), a drain whose stop never ran shut the next deployment's engines down."""
    service.set_ready(False)
    service.begin_drain(0.0)
    service.begin_deploy()
    assert service.view()["ready"] is False and service.drain_left() is None
    assert service.heartbeat("r1", -1, {})["drain_s"] is None
    service.set_ready(True)
    assert service.view()["ready"] is True


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=4, ignore_eos=True),
                                    SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0, seed=3)], ids=["greedy", "sampled"])
def test_a_replica_lost_after_the_final_output_is_not_retried(replica, tiny_llama_dir, params) -> None:
    """The replica died after its last output but before its stream's end: a greedy request was
    replayed on another replica (a second final output, counted twice in /metrics), a sampled one
    failed after its reply was complete. The final output ends the request."""
    import ray

    from runtime.distributed.replica_set import ReplicaSetEngine

    async def wire() -> list[Any]:
        return [item async for item in replica.generate("req", "hello there", params, None)]

    sent = asyncio.run(wire())
    assert sent[-1][1].finished

    async def dies_after_final(*args: Any) -> Any:
        for item in sent:
            yield item
        raise ray.exceptions.RayActorError()

    async def replays(*args: Any) -> Any:
        for item in sent:
            yield item

    replicas = ScriptedReplicas(dies_after_final, replays)
    ingress = ReplicaSetEngine(replicas, None, str(tiny_llama_dir), "tiny", 64)
    seen: list[Any] = []
    ingress.add_observer(seen.append)

    async def run() -> list[Any]:
        return [d async for d in ingress.generate("req", "hello there", params, None)]

    got = asyncio.run(run())
    assert len(replicas.calls) == 1 and [d.finished for d in got].count(True) == 1 and len(seen) == 1


def test_a_request_cancelled_during_admission_leaves_no_metrics_behind(replica, monkeypatch) -> None:
    """Its abort lands from a done-callback after the replica's stream ended: the replica kept its
    metrics record for ever (one entry per such request)."""
    engine = replica.engine.engine
    real_check = engine.check_request
    gate, entered = threading.Event(), threading.Event()

    def slow_check(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(5)
        return real_check(*args, **kwargs)

    monkeypatch.setattr(engine, "check_request", slow_check)

    async def run() -> None:
        async def consume() -> None:
            async for _ in replica.generate("leaky", "hello there", SamplingParams(max_tokens=50, ignore_eos=True), None):
                pass

        task = asyncio.create_task(consume())
        while not entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gate.set()
        for _ in range(100):  # the abort reaches the observer from the engine's threads
            await asyncio.sleep(0.02)
            if not engine.has_unfinished():
                break

    asyncio.run(run())
    assert replica._finished == {} and not replica._streaming


def test_the_ingress_takes_the_registry_view_after_an_admin_call_that_failed_to_apply(service, tiny_llama_dir, monkeypatch) -> None:
    """A load recorded in the registry but refused by some replica (a 503) left the ingress on the old
    revision until its next refresh: requests did not carry the new one to lagging replicas."""
    from runtime.distributed import replica_set
    from runtime.distributed.replica_set import ReplicaSetEngine

    monkeypatch.setattr(replica_set, "ray", SimpleNamespace(get=asyncio.run))
    ingress = ReplicaSetEngine(None, LocalHandle(service), str(tiny_llama_dir), "tiny", 64)

    def recorded_then_refused(name: str, path: str, *, within: Any = None) -> Any:
        service.register(name, path, "0" * 64, 4)
        raise ReplicasFailedToApply("register", name, {"replica-1": [f"{name}: cannot read"]})

    monkeypatch.setattr(ingress.client, "register", recorded_then_refused)
    with pytest.raises(ReplicasFailedToApply):
        ingress.register_adapter("A", "/adapters/a")
    assert ingress._view["revision"] == service.manifest.revision == 1


def test_an_admin_call_s_own_answer_wins_over_the_view_refresh_after_it(tiny_llama_dir, monkeypatch, caplog) -> None:
    """The ingress takes the registry's view after every admin call, in the call's ``finally``: with
    the registry gone, that fetch's RayActorError replaced the call's own answer (a 400 for files that
    do not validate became a 500), and failed a change that was made. Now the call's answer stands,
    and the failed fetch is logged."""
    from runtime.distributed import replica_set
    from runtime.distributed.replica_set import ReplicaSetEngine

    monkeypatch.setattr(replica_set, "ray", SimpleNamespace(get=asyncio.run))
    ingress = ReplicaSetEngine(None, GoneRegistry(), str(tiny_llama_dir), "tiny", 64)
    refused = SimpleNamespace(result=lambda: {"error": "/adapters/a: adapter_config.json: r must be positive"})
    ingress.client.replicas = SimpleNamespace(validate_adapter=SimpleNamespace(remote=lambda name, path: refused))
    with caplog.at_level("WARNING", logger="lorafleet"), pytest.raises(ValueError, match="r must be positive"):
        ingress.register_adapter("A", "/adapters/a")

    def not_registered(name: str) -> None:
        raise UnknownAdapterError(f"adapter {name!r} is not registered")

    monkeypatch.setattr(ingress.client, "unregister", not_registered)
    with pytest.raises(UnknownAdapterError):
        ingress.unregister_adapter("B")
    monkeypatch.setattr(ingress.client, "register", lambda name, path, within=None: AdapterRef(name, "0" * 64))
    assert ingress.register_adapter("C", "/adapters/c") == AdapterRef("C", "0" * 64)  # made, then the registry went
    lines = [r.getMessage() for r in caplog.records if r.name == "lorafleet.replica_set"]
    assert len(lines) == 3 and all("could not take the registry's view" in line and "RayActorError" in line for line in lines), lines


def test_a_replica_that_died_without_a_goodbye_is_forgotten_after_a_while(service: AdapterRegistryService, monkeypatch) -> None:
    """Its entry stays while it might come back, is dropped long after it stopped being live, and
    a replica that does come back is recorded again."""
    import runtime.distributed.registry_service as module

    clock = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    service.heartbeat("dead", 0, {"running": 1})
    service.heartbeat("alive", 0, {})
    clock[0] += service.live_after_s + 1
    service.heartbeat("alive", 0, {})
    assert set(service.live_replicas()) == {"alive"} and "dead" in service.replicas
    clock[0] += service.forget_after_s
    service.heartbeat("alive", 0, {})
    assert set(service.replicas) == {"alive"}
    service.heartbeat("dead", 0, {})  # back after all
    assert set(service.live_replicas()) == {"alive", "dead"}


def test_a_replica_applying_a_slow_update_stays_live_so_the_admin_call_waits_for_it(replica, service, folders, monkeypatch) -> None:
    """Reading a large adapter can outlast the registry's live_after_s. The replica sent no
    heartbeat meanwhile, dropped out of the live set, and wait_applied (what the admin call
    waits on) returned at once with nobody lagging, before the replica had applied anything."""
    service.live_after_s = 0.3
    monkeypatch.setattr(LoraReplica, "KEEPALIVE_S", 0.05)
    real_apply = replica._apply

    def slow_apply(state):  # type: ignore[no-untyped-def]
        time.sleep(1.0)
        return real_apply(state)

    monkeypatch.setattr(replica, "_apply", slow_apply)
    revision = record(replica, service, "A", folders.v1)["revision"]

    async def main() -> tuple[dict, bool]:
        sync = asyncio.ensure_future(replica._sync_once())
        await asyncio.sleep(0.6)  # past live_after_s, the apply still running
        waited = await service.wait_applied(revision, timeout_s=0.2)
        await sync
        return waited, "A" in held(replica)

    waited, applied = asyncio.run(main())
    assert waited["lagging"] == ["replica-1"] and waited["applied"] == [], waited
    assert applied and service.live_replicas()["replica-1"]["applied_revision"] == revision


def test_a_heartbeat_during_an_apply_never_pairs_one_revision_s_errors_with_another_s_number(replica, service, folders, monkeypatch) -> None:
    """The keep-alive heartbeats run while _apply records its outcome in a thread. Recorded field by
    field, a heartbeat could send revision 2 as attempted with revision 1's errors: wait_applied(2)
    then saw A's old error instead of B's, and `register B` answered 200 though B failed here."""
    import traceback

    record(replica, service, "A", folders.v1)
    hidden_a = folders.v1.rename(folders.root / "hidden-a")  # revision 1: A's files are not on this node yet
    sync(replica)
    assert replica.apply_errors and replica.apply_errors[0].startswith("A: ")
    hidden_a.rename(folders.v1)
    revision = record(replica, service, "B", folders.v2)["revision"]
    folders.v2.rename(folders.root / "hidden-b")  # revision 2: A is there now, B is not
    monkeypatch.setattr(LoraReplica, "KEEPALIVE_S", 0.05)
    real_adapters = replica.engine.adapters

    def adapters():  # type: ignore[no-untyped-def]
        if any(frame.name == "_record_apply" for frame in traceback.extract_stack()):
            time.sleep(0.3)  # a slow moment inside _record_apply (a GIL switch, a log write)
        return real_adapters()

    monkeypatch.setattr(replica.engine, "adapters", adapters)

    async def main() -> dict:
        syncing = asyncio.ensure_future(replica._sync_once())
        waited = await service.wait_applied(revision, timeout_s=5.0, poll_s=0.01)
        await syncing
        return waited

    waited = asyncio.run(main())
    assert [e.split(":")[0] for e in waited["errors"]["replica-1"]] == ["B"], waited
