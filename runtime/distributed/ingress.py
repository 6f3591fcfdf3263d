"""The ingress deployment: the same FastAPI app as ``lorafleet serve``, around a ReplicaSetEngine.

The app is built at replica start (``__serve_build_asgi_app__``), after the replica
deployment told us the model's name and length limit, so the routes, validation, admin
rules and error shapes are exactly the single server's.
"""
from __future__ import annotations

from typing import Any

import ray
from ray import serve

from runtime.distributed.replica_set import ReplicaSetEngine
from runtime.server.app import create_app
from runtime.server.options import ServerOptions


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
    ) -> None:
        info = await replicas.describe.remote()
        self.options = options
        self.engine = ReplicaSetEngine(
            replicas,
            ray.get_actor(registry_name, namespace=namespace),
            model_dir,
            info["model_name"],
            info["max_model_len"],
            routing=routing,
            apply_timeout_s=apply_timeout_s,
        )
        await self.engine.refresh()
        self.engine.start_refresh()

    async def sync_registry(self) -> None:
        """Take the registry's current view now, instead of at the next periodic refresh
        (``deploy`` calls this after registering the initial adapters, so that the first
        request, e.g. ``/v1/models``, already sees all of them)."""
        await self.engine.refresh()

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.engine, self.options, replica_snapshots=self.engine.replica_snapshots)
