"""The Serve deployment that generates: one ``AsyncLLMEngine`` per replica.

Routing: the ingress calls ``generate`` with ``multiplexed_model_id=<adapter name>``.
``load_adapter`` below is wired with ``serve.multiplexed(max_num_models_per_replica=
max_cpu_loras)``: the replica reports the adapters it holds, and Serve's router sends
requests for an adapter to a replica that already holds it (pow-2 among those; a
replica with free room when none does). The capacity equals the engine's host tier, so
"held by Serve" and "warm in the engine's LRU" describe the same set.

Registry: every replica registers the application's whole adapter set in its engine
(registration is metadata + one validation read; weights then live in the engine's
host/device LRU only while used). A background task heartbeats the registry actor,
applies newer revisions, and reports the engine snapshot for /metrics.

Wire format of ``generate``: a stream of tuples, so that admission errors cross the
process boundary as data, not as pickled exception classes:
    ("out", RequestOutput, RequestMetrics | None)   metrics with the final output
    ("error", kind, message)                       kind in ERROR_KINDS
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import ray
from ray import serve

from runtime.async_engine import AsyncLLMEngine, EngineDeadError
from runtime.config import EngineConfig
from runtime.request import PromptTooLongError, RequestRejected, SamplingParams, UnknownAdapterError

logger = logging.getLogger("lorafleet.replica")

ERROR_KINDS: dict[str, type[Exception]] = {
    "unknown_adapter": UnknownAdapterError,
    "prompt_too_long": PromptTooLongError,
    "rejected": RequestRejected,
    "invalid": ValueError,
    "engine_dead": EngineDeadError,
}


def error_item(err: Exception) -> tuple[str, str, str]:
    for kind, cls in ERROR_KINDS.items():  # most specific first: ValueError subclasses precede it
        if isinstance(err, cls):
            return ("error", kind, str(err))
    raise err


@dataclass(frozen=True)
class AdapterLease:
    """What Serve's multiplexing cache holds for an adapter: its name and the version seen."""

    name: str
    version: str


class LoraReplica:
    async def __init__(self, engine_config: EngineConfig, registry_name: str, namespace: str, sync_interval_s: float = 0.25) -> None:
        engine = AsyncLLMEngine(engine_config)
        engine.start()
        self._setup(engine, ray.get_actor(registry_name, namespace=namespace), serve.get_replica_context().replica_id.unique_id, sync_interval_s)

        async def load_adapter(name: str) -> AdapterLease:
            return await self._lease(name)

        # Wired at init because the capacity comes from the engine config; Serve detects
        # multiplexing set up this way on the instance. (A plain function, not the bound
        # method: Serve caches its state on the decorated object.)
        self.load_adapter = serve.multiplexed(max_num_models_per_replica=engine_config.max_cpu_loras)(load_adapter)
        await asyncio.to_thread(self._apply, await self.registry.state.remote())
        self._sync_task = asyncio.create_task(self._sync_loop())

    def _setup(self, engine: AsyncLLMEngine, registry: Any, replica_id: str, sync_interval_s: float) -> None:
        """The replica's state around an engine and a registry handle (``__init__`` without Serve:
        tests build a replica this way, with a local registry, and call its methods directly)."""
        self.engine = engine
        self.replica_id = replica_id
        self.registry = registry
        self.sync_interval_s = sync_interval_s
        self.applied_revision = -1
        self.apply_errors: tuple[str, ...] = ()
        self._sync_lock = asyncio.Lock()
        self._metrics_lock = threading.Lock()
        self._finished: dict[str, Any] = {}
        self.engine.add_observer(self._observe)

    # ---- the registered set ------------------------------------------------------------------
    def _apply(self, state: dict[str, Any]) -> None:
        """Make this engine's adapter set equal the registry's revision (runs off the event loop)."""
        wanted = {e["name"]: e for e in state["entries"]}
        have = {a.name: a for a in self.engine.adapters()}
        errors = []
        for name, entry in wanted.items():
            if name in have and have[name].version == entry["version"]:
                continue
            try:
                ref = self.engine.register_adapter(name, entry["path"])
            except (ValueError, OSError) as err:
                errors.append(f"{name}: {err}")
                continue
            if ref.version != entry["version"]:
                # The files changed since the registry validated them: serving them would
                # give this replica different weights than the others under the same name.
                self.engine.unregister_adapter(name)
                errors.append(f"{name}: {entry['path']} now has version {ref.version}, registered {entry['version']}; load it again")
        for name in set(have) - set(wanted):
            self.engine.unregister_adapter(name)
        self.applied_revision = state["revision"]
        self.apply_errors = tuple(errors)
        for e in errors:
            logger.error("replica %s: %s", self.replica_id, e)

    async def _sync_once(self) -> None:
        async with self._sync_lock:
            for _ in range(2):  # a second heartbeat acknowledges what the first one delivered
                state = await self.registry.heartbeat.remote(self.replica_id, self.applied_revision, self.report(), self.apply_errors)
                if state is None:
                    return
                await asyncio.to_thread(self._apply, state)

    async def _sync_loop(self) -> None:
        while True:
            try:
                await self._sync_once()
            except ray.exceptions.RayActorError as err:  # the registry restarts from its manifest; keep serving
                logger.warning("replica %s: registry unavailable (%s); retrying", self.replica_id, err)
            await asyncio.sleep(self.sync_interval_s)

    def report(self) -> dict[str, Any]:
        """The engine snapshot plus ``registered`` (name -> version), so the registry shows who holds what."""
        snap = self.engine.snapshot()
        snap["registered"] = {a.name: a.version for a in self.engine.adapters()}
        return snap

    async def _lease(self, name: str) -> AdapterLease:
        """Serve's multiplexed loader: make sure ``name`` is registered here (syncing if needed)."""
        info = next((a for a in self.engine.adapters() if a.name == name), None)
        if info is None:
            await self._sync_once()
            info = next((a for a in self.engine.adapters() if a.name == name), None)
        if info is None:
            raise UnknownAdapterError(f"adapter {name!r} is not registered in the application")
        return AdapterLease(name, info.version)

    # ---- requests ------------------------------------------------------------------------------
    def _observe(self, metrics: Any) -> None:
        with self._metrics_lock:
            self._finished[metrics.request_id] = metrics

    async def generate(self, request_id: str, prompt: Any, params: Optional[SamplingParams], adapter: Optional[str]) -> AsyncIterator[tuple]:
        if adapter is not None:
            try:
                await self.load_adapter(adapter)
            except UnknownAdapterError as err:
                yield error_item(err)
                return
        stream = self.engine.generate(request_id, prompt, params, adapter)
        try:
            async for out in stream:
                metrics = None
                if out.finished:
                    with self._metrics_lock:
                        metrics = self._finished.pop(request_id, None)
                yield ("out", out, metrics)
        except (ValueError, EngineDeadError) as err:  # admission errors, raised before the first output
            yield error_item(err)
        finally:
            await stream.aclose()  # aborts the engine request if the caller went away
            with self._metrics_lock:
                self._finished.pop(request_id, None)

    async def validate_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Read and validate adapter files against this replica's model; engine state is untouched."""
        try:
            adapter = await asyncio.to_thread(self.engine.engine.load_adapter_files, name, path)
        except (ValueError, OSError) as err:
            return {"error": str(err)}
        return {"version": adapter.version, "max_rank": adapter.max_rank}

    def describe(self) -> dict[str, Any]:
        return {"model_name": self.engine.model_name, "max_model_len": self.engine.max_model_len, "replica_id": self.replica_id}

    def check_health(self) -> None:
        """Serve restarts a replica whose engine loop died."""
        if self.engine.dead_error is not None:
            raise RuntimeError(f"replica {self.replica_id}: {self.engine.dead_error}")

    def __del__(self) -> None:
        task = getattr(self, "_sync_task", None)
        if task is not None:
            task.cancel()
        if getattr(self, "registry", None) is not None:
            self.registry.forget.remote(self.replica_id)
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown(timeout=5.0)
