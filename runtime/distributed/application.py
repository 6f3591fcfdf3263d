"""Build, deploy and stop the lorafleet Ray Serve application.

    ingress (1 replica, the FastAPI app)  --multiplexed_model_id=adapter-->  LoraReplica x N
            \\                                                               /
             `---------- registry actor "lorafleet-registry-<app>" ---------'   (manifest on disk)

The registry actor is created here, before the deployments, as a detached named actor
pinned to the node that deploys (its manifest folder lives there; on a multi-node
cluster use a folder on shared storage so a restart on another node finds it).
``stop`` deletes the application and the actor; the manifest stays, and the next
``deploy`` with the same ``registry_dir`` serves the same adapter set.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import ray
from ray import serve
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import backends
from runtime.config import EngineConfig
from runtime.distributed.ingress import LoraIngress
from runtime.distributed.registry_client import RegistryClient
from runtime.distributed.registry_service import AdapterRegistryService
from runtime.distributed.replica import LoraReplica
from runtime.distributed.replica_set import ROUTINGS
from runtime.server.options import ServerOptions

NAMESPACE = "lorafleet"
REPLICA_DEPLOYMENT = "LoraReplica"
INGRESS_DEPLOYMENT = "LoraIngress"


@dataclass(frozen=True)
class ScaleOutConfig:
    """
    engine:            each replica's engine (its adapter pool: max_loras on device, max_cpu_loras in host)
    server:            the ingress's HTTP options (host/port/admin/api key/adapter roots)
    num_replicas:      generating replicas
    registry_dir:      folder of the persisted adapter manifest
    app_name:          Serve application name (also names the registry actor)
    routing:           "affinity" (multiplexed by adapter) or "adapter_blind" (the baseline)
    replica_resources: Ray actor options of one replica, e.g. {"num_gpus": 1}; default:
                       one GPU for device cuda, one "NPU" resource for npu, else {"num_cpus": 1},
                       after ``replica_device`` resolves "auto"
    apply_timeout_s:   how long an admin change waits for live replicas to apply it
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

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas: expected >= 1, got {self.num_replicas}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing: {self.routing!r} is not one of {', '.join(ROUTINGS)}")

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


def start_registry(cfg: ScaleOutConfig) -> Any:
    """The application's registry actor (created, or the running one); loads the manifest."""
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
    ray.get(actor.state.remote())  # surface a bad manifest here, with its file and field
    return actor


def build(cfg: ScaleOutConfig) -> Any:
    max_ongoing = cfg.max_ongoing_requests or max(8, 2 * cfg.engine.max_num_seqs)
    replica = serve.deployment(
        LoraReplica,
        name=REPLICA_DEPLOYMENT,
        num_replicas=cfg.num_replicas,
        ray_actor_options=cfg.replica_actor_options(),
        max_ongoing_requests=max_ongoing,
        health_check_period_s=2,
        graceful_shutdown_timeout_s=10,
    ).bind(cfg.replica_engine(), cfg.registry_name, NAMESPACE)
    ingress = serve.deployment(
        LoraIngress, name=INGRESS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=max(256, max_ongoing * cfg.num_replicas)
    ).bind(replica, cfg.engine.model, cfg.server, cfg.registry_name, NAMESPACE, cfg.routing, cfg.apply_timeout_s)
    return ingress


def deploy(cfg: ScaleOutConfig) -> Any:
    """Start Serve's HTTP proxy on cfg.server.host:port, deploy, register ``initial_adapters``.

    Returns the ingress handle. Blocks until every replica is up and the ingress serves
    the initial adapters.
    """
    serve.start(http_options={"host": cfg.server.host, "port": cfg.server.port})
    registry = start_registry(cfg)
    handle = serve.run(build(cfg), name=cfg.app_name, route_prefix="/")
    if cfg.initial_adapters:
        client = RegistryClient(registry, serve.get_deployment_handle(REPLICA_DEPLOYMENT, cfg.app_name), cfg.apply_timeout_s)
        for name, path in cfg.initial_adapters:
            client.register(name, path)
        handle.sync_registry.remote().result()  # the ingress refreshes every 0.5 s; do not serve a stale set first
    return handle


def stop(cfg: ScaleOutConfig) -> None:
    """Delete the application and its registry actor; the manifest on disk stays."""
    serve.delete(cfg.app_name)
    try:
        ray.kill(ray.get_actor(cfg.registry_name, namespace=NAMESPACE), no_restart=True)
    except ValueError:  # not running: nothing to stop
        return


def with_routing(cfg: ScaleOutConfig, routing: str) -> ScaleOutConfig:
    return dataclasses.replace(cfg, routing=routing)
