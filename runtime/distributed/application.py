"""Build, deploy and stop the lorafleet Ray Serve application.

    ingress (1 replica, the FastAPI app)  --multiplexed_model_id=adapter-->  LoraReplica x N
            \\                                                               /
             `---------- registry actor "lorafleet-registry-<app>" ---------'   (manifest on disk)

The registry actor is created here, before the deployments, as a detached named actor
pinned to the node that deploys (its manifest folder lives there; a restart of the actor
reloads the manifest on that node).
``stop`` deletes the application and the actor; the manifest stays, and the next
``deploy`` with the same ``registry_dir`` serves the same adapter set.

Shutdown (``lorafleet serve --ray`` on SIGTERM): ``drain`` first, as a single server drains
its engine: the ingress answers new requests and /health with a 503 ``engine_unavailable``,
each replica's engine lets its requests in flight run for ``DRAIN_S`` and fails the rest
(503 ``engine_unavailable``; a stream: an error event, then [DONE]); then ``stop``. Serve's
own graceful shutdown timeouts are longer than the drain (the ingress's longer than the
replicas'), so it never cuts what the drain still relays.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import ray
from ray import serve
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import backends
from runtime.config import EngineConfig, check_every_decode_fits, check_host_tier_counted
from runtime.distributed.ingress import LoraIngress
from runtime.distributed.log_level import LOG_LEVELS
from runtime.distributed.manifest import ManifestError
from runtime.distributed.ray_failure import ray_failure
from runtime.distributed.registry_client import RegistryClient
from runtime.distributed.registry_service import REGISTRY_PROTOCOL, AdapterRegistryService
from runtime.distributed.replica import LoraReplica
from runtime.distributed.replica_set import ROUTINGS
from runtime.distributed.shutdown_timeouts import (  # noqa: F401 - DRAIN_MARGIN_S and the check are this module's API too
    DRAIN_MARGIN_S,
    DRAIN_S,
    INGRESS_GRACEFUL_SHUTDOWN_S,
    REPLICA_GRACEFUL_SHUTDOWN_S,
    check_shutdown_timeouts,
)
from runtime.server.options import ServerOptions

logger = logging.getLogger("lorafleet.application")

NAMESPACE = "lorafleet"
REPLICA_DEPLOYMENT = "LoraReplica"
INGRESS_DEPLOYMENT = "LoraIngress"

# The shutdown's timeouts (DRAIN_S, DRAIN_MARGIN_S, Serve's graceful shutdown timeouts) and their
# check are in shutdown_timeouts.py (the ingress checks a drain it is asked for too).
# Serve calls check_health every HEALTH_CHECK_PERIOD_S and gives up on a call after
# HEALTH_CHECK_TIMEOUT_S; 3 failures in a row (a hung replica: ~15 s) and it replaces the replica.
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 5.0
# Serve stops an unhealthy replica gracefully by default, i.e. waits up to its graceful shutdown
# timeout for a replica that does not answer any more; a Serve started here stops it at once.
SERVE_CONTROLLER_ENV = {"RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1"}


class StartError(Exception):
    """The application cannot start as configured (the message is one line, for the CLI)."""


class DeployError(Exception):
    """A step of ``deploy`` after the registry actor was created failed in Ray: the registry actor
    or the ingress died (or raised) while the application was being made ready, or Serve could not
    start a deployment's replicas (their constructor raised: ``deploy_failure``). The message is one
    line, for the CLI; ``stop`` deletes what was deployed."""


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def replica_start_error(message: str) -> str:
    """The first useful line of a Serve deployment's status message after its replicas failed to
    start ("The deployment failed to start 3 times in a row. ... Error:\n<the replica's error>",
    that error often a remote traceback): the line after the traceback's last frame, i.e. the
    ``Kind: message`` the constructor raised (the kind without its module), else the error's
    first line (e.g. "The actor died unexpectedly ...")."""
    _, sep, detail = message.partition("Error:\n")
    lines = _ANSI_ESCAPE.sub("", detail if sep else message).splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    after = lines[frames[-1] + 1:] if frames else lines
    # After the last frame: its source line (indented), then the exception's line (not indented).
    first = next((line.strip() for line in after if line.strip() and not line[:1].isspace()), None)
    if first is None:
        first = next((line.strip() for line in lines if line.strip()), message.strip())
    kind, sep, text = first.partition(": ")
    if sep and re.fullmatch(r"[A-Za-z_][\w.]*", kind):
        first = f"{kind.rsplit('.', 1)[-1]}: {text}"
    return first


def deploy_failure(app_name: str, err: BaseException) -> str:
    """One line for ``serve.run``'s failure (``err``: "Deploying application <app> failed: Failed to
    update the deployments ['LoraReplica']."; the replicas' own error is only in each deployment's
    status, ``serve.status()``): which deployment could not start, and ``replica_start_error`` of it."""
    try:
        deployments = serve.status().applications[app_name].deployments
        failed = [(name, d.message) for name, d in sorted(deployments.items()) if d.status == "DEPLOY_FAILED"]  # a str Enum
    except Exception:  # noqa: BLE001 - Serve's status is unreadable: say what serve.run said
        failed = []
    if not failed:
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        return f"Ray Serve could not deploy the application ({first}); nothing is served (Ray's logs have the details)"
    what = "; ".join(f"the {name} deployment: {replica_start_error(message)}" for name, message in failed)
    return f"Ray Serve could not start the application's replicas ({what}); nothing is served (Ray's logs have the whole error)"


def _start_step(what: str, call: Callable[[], Any]) -> Any:
    """``call()``, one of ``deploy``'s calls to the registry actor or the ingress; ``DeployError``
    naming ``what`` when Ray raises (the actor died, or the call raised there)."""
    try:
        return call()
    except ray.exceptions.RayError as err:
        raise DeployError(f"{what} failed during start-up ({ray_failure(err)}); nothing is served: start again") from err


@dataclass(frozen=True)
class ScaleOutConfig:
    """
    engine:            each replica's engine (its adapter pool: max_loras on device, max_cpu_loras in host, and
                       max_cpu_lora_bytes if given; max_cpu_loras is then needed too: ``check_host_tier_counted``)
    server:            the ingress's HTTP options (host/port/admin/api key/adapter roots)
    num_replicas:      generating replicas
    registry_dir:      folder of the persisted adapter manifest
    app_name:          Serve application name (also names the registry actor)
    routing:           "affinity" (multiplexed by adapter) or "adapter_blind" (the baseline)
    replica_resources: Ray actor options of one replica, e.g. {"num_gpus": 1}; default:
                       one GPU for device cuda, one "NPU" resource for npu, else {"num_cpus": 1},
                       after ``replica_device`` resolves "auto"
    apply_timeout_s:   how long an admin change waits for live replicas to apply it
    log_level:         lorafleet's log level inside the ingress and replica actors (``log_level.py``)

    Raises ConfigError (a ValueError) for an engine whose step budget is below max_num_seqs, as
    ``lorafleet serve`` does (``check_every_decode_fits``): the replicas are servers; and for one
    whose host tier has no entry bound (``check_host_tier_counted``).
    """

    engine: EngineConfig
    server: ServerOptions
    num_replicas: int
    registry_dir: str
    app_name: str = "lorafleet"
    routing: str = "affinity"
    replica_resources: Mapping[str, Any] | None = None
    apply_timeout_s: float = 30.0
    max_ongoing_requests: int | None = None
    initial_adapters: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas: expected >= 1, got {self.num_replicas}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing: {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        # Serve's rule, here so that every way to build the application (a RayService, a script,
        # ``benchmarks/ray_affinity.py``) gets it, not only ``lorafleet serve``: its settings check
        # it first, so a config it builds never fails here and the message is said once.
        check_every_decode_fits(self.engine)
        check_host_tier_counted(self.engine)  # Serve's affinity counts adapters per replica

    @property
    def registry_name(self) -> str:
        return f"lorafleet-registry-{self.app_name}"

    @property
    def replica_device(self) -> str:
        """engine.device with "auto" resolved as a single server resolves it (``backends.resolve_name``:
        cuda, then npu, then cpu), on the machine that builds the application."""
        return backends.resolve_name(self.engine.device)

    def replica_engine(self) -> EngineConfig:
        """Each replica's engine config: ``engine`` with the device resolved, so a replica runs on
        the device its actor options reserve."""
        return dataclasses.replace(self.engine, device=self.replica_device)

    def replica_actor_options(self) -> dict[str, Any]:
        if self.replica_resources is not None:
            return dict(self.replica_resources)
        device = self.replica_device
        if device == "cuda":
            return {"num_gpus": 1}
        if device == "npu":
            return {"resources": {"NPU": 1}}
        return {"num_cpus": 1}


def start_serve(cfg: ScaleOutConfig) -> None:
    """Start Serve with its HTTP proxy on cfg.server.host:port, or join the Serve running on the
    cluster. Raises StartError when the proxy cannot listen there, or when the running Serve's
    proxy listens elsewhere (Serve keeps its address: the application would not be served on
    the address asked for). Nothing is deployed or deleted here."""
    host, port = cfg.server.host, cfg.server.port
    try:
        serve.start(http_options={"host": host, "port": port}, controller_options={"runtime_env": {"env_vars": dict(SERVE_CONTROLLER_ENV)}},
                    logging_config=serve_logging(cfg))  # fmt: skip
    except RuntimeError as err:  # ray.exceptions.RayTaskError(RuntimeError) from the proxy actor's start
        cause = getattr(err, "cause", err)
        if "Failed to bind" not in str(cause):
            raise
        serve.shutdown()  # the Serve instance started just now, with no proxy: do not leave it behind
        raise StartError(f"cannot listen on {host}:{port}: {cause}") from err
    actual_host, actual_port = serve_http_address()
    if (actual_host, actual_port) != (host, port):
        raise StartError(
            f"Ray Serve already runs on this cluster with its HTTP proxy on {actual_host}:{actual_port}, and keeps that address: "
            f"cannot serve on {host}:{port}; pass --host {actual_host} --port {actual_port}, or shut that Serve down first (serve shutdown)"
        )


def serve_http_address() -> tuple[str, int]:
    """The host and port Serve's HTTP proxy was started with (on a cluster where Serve already
    ran, that instance's; a new ``serve.start`` does not change them)."""
    from ray.serve.context import _get_global_client

    config = _get_global_client().http_config
    return config.host, config.port


def start_registry(cfg: ScaleOutConfig) -> Any:
    """The application's registry actor (created, or the running one); loads the manifest.

    Raises ManifestError (one line, naming the file) when the manifest cannot be loaded or the
    folder cannot be created: the actor's constructor failed with it. Raises StartError when the
    running actor (from a start that was never stopped: the actor is detached, and Ray hands back
    an existing one without its arguments) keeps another folder than ``cfg.registry_dir``: it
    would serve and persist that folder's adapters, and when it runs another lorafleet version's
    code (``registry_protocol``): its calls are not this version's (an admin load's ``within`` was
    a TypeError there, a 500)."""
    node = ray.get_runtime_context().get_node_id()
    actor = (
        ray.remote(AdapterRegistryService)
        .options(
            name=cfg.registry_name,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,  # a restart reloads the manifest
            max_task_retries=3,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        )
        .remote(cfg.registry_dir)
    )
    try:
        ray.get(actor.state.remote())  # surface a bad manifest here, with its file and field
    except ray.exceptions.RayActorError as err:
        if not err.actor_init_failed:
            raise
        raise ManifestError(creation_error(err)) from err
    running = registry_protocol(actor)
    if running != REGISTRY_PROTOCOL:
        raise StartError(f"the registry actor {cfg.registry_name!r} (namespace {NAMESPACE!r}) of an earlier start that was not stopped "
                         f"runs another lorafleet version (registry protocol {running}, this one needs {REGISTRY_PROTOCOL}), whose calls "
                         f"differ: remove that actor first ({registry_stop_call(cfg)}; its manifest stays), then start again")  # fmt: skip
    held, wanted = ray.get(actor.folder.remote()), str(Path(cfg.registry_dir).expanduser().resolve())
    if held != wanted:
        raise StartError(f"the registry actor {cfg.registry_name!r} (namespace {NAMESPACE!r}) of an earlier start that was not stopped "
                         f"still runs on registry_dir {held}, not {wanted}: pass --registry-dir {held}, or remove that actor first "
                         f"({registry_stop_call(cfg)})")  # fmt: skip
    return actor


def registry_stop_call(cfg: ScaleOutConfig) -> str:
    """The Ray call that removes the application's registry actor for good (as ``stop`` does),
    for a driver connected to its cluster."""
    return f"ray.kill(ray.get_actor({cfg.registry_name!r}, namespace={NAMESPACE!r}))"


def registry_protocol(actor: Any) -> int:
    """The running registry actor's ``REGISTRY_PROTOCOL``; 1 for an actor from before its
    ``protocol()`` existed. Ray's handle to an existing actor carries that actor's methods, so
    the call is not there (AttributeError); a handle built from this class reaches an actor
    without it (its AttributeError, raised there)."""
    try:
        call = actor.protocol
    except AttributeError:
        return 1
    try:
        return int(ray.get(call.remote()))
    except ray.exceptions.RayTaskError as err:
        if isinstance(getattr(err, "cause", None), AttributeError) or isinstance(err, AttributeError):
            return 1
        raise


def creation_error(err: Exception) -> str:
    """The error an actor's constructor raised, in one line, from Ray's report of it (Ray keeps
    only its text: the traceback, whose last line is ``module.Error: message``)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    last = lines[-1] if lines else repr(err)
    kind, sep, message = last.partition(": ")
    if not sep or not re.fullmatch(r"[\w.]+", kind):
        return f"the adapter registry actor failed to start: {last}"
    kind = kind.rsplit(".", 1)[-1]
    return message if kind == ManifestError.__name__ else f"the adapter registry actor failed to start: {kind}: {message}"


def serve_logging(cfg: ScaleOutConfig) -> dict[str, str]:
    """Serve's own logging (its controller, proxy and the deployments' replica and access logs) at
    ``--log-level``: at warning, Serve's per-request INFO lines go too."""
    return {"log_level": cfg.log_level.upper()}


def build(cfg: ScaleOutConfig) -> Any:
    check_shutdown_timeouts(DRAIN_S)  # the drain ``lorafleet serve --ray`` runs
    max_ongoing = cfg.max_ongoing_requests or max(8, 2 * cfg.engine.max_num_seqs)
    replica = serve.deployment(
        LoraReplica,
        name=REPLICA_DEPLOYMENT,
        num_replicas=cfg.num_replicas,
        ray_actor_options=cfg.replica_actor_options(),
        max_ongoing_requests=max_ongoing,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=REPLICA_GRACEFUL_SHUTDOWN_S,
        logging_config=serve_logging(cfg),
    ).bind(cfg.replica_engine(), cfg.registry_name, NAMESPACE, log_level=cfg.log_level)
    ingress = serve.deployment(
        LoraIngress, name=INGRESS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=max(256, max_ongoing * cfg.num_replicas),
        graceful_shutdown_timeout_s=INGRESS_GRACEFUL_SHUTDOWN_S, logging_config=serve_logging(cfg),
    ).bind(replica, cfg.engine.model, cfg.server, cfg.registry_name, NAMESPACE, cfg.routing, cfg.apply_timeout_s, log_level=cfg.log_level)
    return ingress


def deploy(cfg: ScaleOutConfig) -> Any:
    """Start Serve's HTTP proxy on cfg.server.host:port (``start_serve``), deploy, register
    ``initial_adapters`` (a replica validates them all before the first is recorded, so one that
    does not load leaves the registry as it was).

    Returns the ingress handle. Blocks until every replica is up and the ingress serves
    the initial adapters; until then it answers /health and requests with a 503
    ``engine_unavailable`` (the registry is not ready), never a 404 for an initial adapter.
    ``DeployError`` when the registry actor or the ingress fails a call of the start-up
    (``_start_step``), or when Serve gives up starting a deployment's replicas (``deploy_failure``).
    """
    start_serve(cfg)
    registry = start_registry(cfg)
    # Not ready, no drain: whatever an earlier deployment left in the detached actor.
    _start_step("resetting the adapter registry actor", lambda: ray.get(registry.begin_deploy.remote()))
    try:
        handle = serve.run(build(cfg), name=cfg.app_name, route_prefix="/")
    except RuntimeError as err:  # Serve's "Deploying application <app> failed: Failed to update the deployments [...]."
        if not str(err).startswith(f"Deploying application {cfg.app_name} failed"):
            raise
        raise DeployError(deploy_failure(cfg.app_name, err)) from err
    if cfg.initial_adapters:
        client = RegistryClient(registry, serve.get_deployment_handle(REPLICA_DEPLOYMENT, cfg.app_name), cfg.apply_timeout_s)
        client.register_all(cfg.initial_adapters)  # every one validated before any is recorded
    _start_step("marking the adapter registry ready", lambda: ray.get(registry.set_ready.remote(True)))
    # The ingress refreshes every 0.5 s; do not wait for that.
    _start_step("the ingress taking the registry's adapter set", lambda: handle.sync_registry.remote().result())
    return handle


def drain(cfg: ScaleOutConfig, drain_s: float = DRAIN_S, interrupted: Callable[[], bool] = lambda: False) -> int:
    """Begin the application's shutdown and wait for its requests in flight (call ``stop`` next).

    The ingress refuses new requests (503 ``engine_unavailable``, /health too) and retries
    nothing any more; each replica's engine stops taking requests, lets those in flight run
    for ``drain_s`` and fails the rest with 503 ``engine_unavailable``. Returns once the
    ingress has no request in flight, after ``drain_s + DRAIN_MARGIN_S`` at the latest, or as
    soon as ``interrupted()`` (a second signal); returns how many were still in flight.
    ValueError (``check_shutdown_timeouts``), before anything begins, for a ``drain_s`` that, with the
    step grace, would not end inside the replicas' graceful shutdown timeout.
    """
    check_shutdown_timeouts(drain_s)
    try:
        ingress = serve.get_app_handle(cfg.app_name)
        ingress.begin_shutdown.remote(drain_s).result(timeout_s=10)
    except Exception as err:  # noqa: BLE001 - no application (it never started), or its ingress is gone: nothing to drain
        logger.warning("lorafleet: could not begin the drain of application %r (%s: %s); stopping it now", cfg.app_name, type(err).__name__, err)
        return 0
    deadline = time.monotonic() + drain_s + DRAIN_MARGIN_S
    active = -1
    while time.monotonic() < deadline and not interrupted():
        try:
            active = ingress.active_requests.remote().result(timeout_s=5)
        except Exception as err:  # noqa: BLE001 - the ingress died meanwhile: nothing left to wait for there
            logger.warning("lorafleet: the ingress stopped answering during the drain (%s: %s)", type(err).__name__, err)
            return 0
        if active == 0:
            return 0
        time.sleep(0.2)
    if active != 0:
        logger.warning("lorafleet: %s request(s) still in flight at the ingress after the drain; stopping anyway", "some" if active < 0 else active)
    return max(active, 0)


def stop(cfg: ScaleOutConfig) -> None:
    """Delete the application and its registry actor; the manifest on disk stays."""
    serve.delete(cfg.app_name)
    try:
        ray.kill(ray.get_actor(cfg.registry_name, namespace=NAMESPACE), no_restart=True)
    except ValueError:  # not running: nothing to stop
        return


def with_routing(cfg: ScaleOutConfig, routing: str) -> ScaleOutConfig:
    return dataclasses.replace(cfg, routing=routing)
