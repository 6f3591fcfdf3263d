"""The ingress deployment: the same FastAPI app as ``lorafleet serve``, around a ReplicaSetEngine.

The app is built at replica start (``__serve_build_asgi_app__``), after the replica
deployment told us the model's name and length limits, so the routes, validation, admin
rules and error shapes are exactly the single server's. One addition (``StartingGate``):
while ``deploy`` still registers the initial adapters, every route answers a 503
``engine_unavailable``, /health too (a request for one of those adapters would be a 404).
"""
from __future__ import annotations

import logging
from typing import Any

import ray
from ray import serve

from runtime.distributed.log_level import apply_log_level
from runtime.distributed.registry_lookup import find_registry
from runtime.distributed.replica_set import ReplicaSetEngine
from runtime.distributed.shutdown_timeouts import check_shutdown_timeouts
from runtime.server.app import create_app
from runtime.server.errors import error_response
from runtime.server.options import ServerOptions

logger = logging.getLogger("lorafleet.ingress")


class StartingGate:
    """ASGI middleware: a 503 ``engine_unavailable`` for every HTTP request while the replica
    set reports the application is starting (``ReplicaSetEngine.dead_error``)."""

    def __init__(self, app: Any, engine: ReplicaSetEngine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        problem = self.engine.dead_error if scope["type"] == "http" else None
        if problem is not None:
            await error_response(503, f"engine unavailable: {problem}", code="engine_unavailable")(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(engine: ReplicaSetEngine, options: ServerOptions) -> Any:
    """The ingress's FastAPI app: ``create_app`` around the replica set, behind ``StartingGate``."""
    app = create_app(engine, options, replica_snapshots=engine.replica_snapshots, fold_replica_counters=engine.fold_replica_adapter_counters)
    app.add_middleware(StartingGate, engine=engine)
    return app


@serve.ingress()
class LoraIngress:
    async def __init__(
        self,
        replicas: Any,
        model_dir: str,
        options: ServerOptions,
        registry_name: str,
        namespace: str,
        routing: str = "affinity",
        apply_timeout_s: float = 30.0,
        log_level: str = "info",
    ) -> None:
        apply_log_level(log_level)
        registry = await find_registry(registry_name, namespace)  # a bounded wait, then one line (RegistryMissing)
        info = await replicas.describe.remote()
        self.options = options
        self.engine = ReplicaSetEngine(
            replicas,
            registry,
            model_dir,
            info["model_name"],
            info["max_model_len"],
            routing=routing,
            apply_timeout_s=apply_timeout_s,
            max_seq_tokens=info.get("max_seq_tokens"),
        )
        self.registry = self.engine.registry
        await self.engine.refresh()
        self.engine.start_refresh()

    async def sync_registry(self) -> None:
        """Take the registry's current view now, instead of at the next periodic refresh
        (``deploy`` calls this after registering the initial adapters, so that the first
        request, e.g. ``/v1/models``, already sees all of them)."""
        await self.engine.refresh()

    async def begin_shutdown(self, drain_s: float) -> None:
        """The application's shutdown begins (``application.drain``): refuse new requests (503
        ``engine_unavailable``, /health too) and retry none; tell the replicas, through the
        registry, to let their requests in flight run for ``drain_s`` and fail the rest.

        ValueError (``check_shutdown_timeouts``), with nothing begun, for a ``drain_s`` that, with
        the step grace, would not end inside the replicas' graceful shutdown timeout: ``drain``
        checks it first, but a script may call this through a Serve handle directly."""
        check_shutdown_timeouts(drain_s)
        self.engine.begin_shutdown()
        try:
            await self.registry.begin_drain.remote(drain_s)
        except ray.exceptions.RayActorError as err:  # restarting: the replicas keep serving until Serve stops them
            logger.error("the registry is unavailable (%s); the replicas do not drain, Serve's graceful shutdown waits for their requests", err)

    def active_requests(self) -> int:
        """Requests in flight at this ingress (the drain waits for none to be left)."""
        return self.engine.active

    def __serve_build_asgi_app__(self) -> Any:
        return build_app(self.engine, self.options)
