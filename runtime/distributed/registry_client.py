"""Changes to the application's adapter set: validate on a replica, record, wait for replicas.

``register``: a replica reads and validates the files against the served model (the
same checks and content hash as a single server), the registry records name -> (path,
version) durably and bumps its revision, then we wait until every live replica applied
that revision (or ``apply_timeout_s`` passes). Blocking; call it from a worker thread
(the admin routes already do).
"""
from __future__ import annotations

import logging
from typing import Any

import ray

from runtime.request import AdapterRef, UnknownAdapterError

logger = logging.getLogger("lorafleet.registry")


class ReplicasFailedToApply(RuntimeError):
    """A live replica could not apply the new revision (e.g. the files changed on disk meanwhile)."""


class RegistryClient:
    def __init__(self, registry: Any, replicas: Any, apply_timeout_s: float = 30.0) -> None:
        self.registry = registry
        self.replicas = replicas
        self.apply_timeout_s = apply_timeout_s

    def register(self, name: str, path: str) -> AdapterRef:
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"adapter name: must be a non-empty string without surrounding spaces, got {name!r}")
        checked = self.replicas.validate_adapter.remote(name, str(path)).result()
        if "error" in checked:
            raise ValueError(checked["error"])
        result = ray.get(self.registry.register.remote(name, str(path), checked["version"], checked["max_rank"]))
        self._wait(result["revision"], f"register {name}@{checked['version']}", name)
        return AdapterRef(name, checked["version"])

    def unregister(self, name: str) -> None:
        revision = ray.get(self.registry.unregister.remote(name))
        if revision is None:
            registered = sorted(e["name"] for e in ray.get(self.registry.state.remote())["entries"])
            raise UnknownAdapterError(f"adapter {name!r} is not registered; registered: {registered or 'none'}")
        self._wait(revision, f"unregister {name}", name)

    def _wait(self, revision: int, what: str, name: str) -> None:
        report = ray.get(self.registry.wait_applied.remote(revision, self.apply_timeout_s))
        failed = {rid: [e for e in errs if e.startswith(f"{name}:")] for rid, errs in report["errors"].items()}
        failed = {rid: errs for rid, errs in failed.items() if errs}
        if failed:
            raise ReplicasFailedToApply(f"{what}: recorded in the registry, but replica(s) failed to apply it: {failed}")
        if report["lagging"]:
            # Recorded durably; lagging replicas apply it on their next heartbeat, and a request
            # routed there first syncs in the multiplexed loader. Say so instead of failing.
            logger.warning("%s: replicas %s had not applied revision %d after %.0fs", what, report["lagging"], revision, self.apply_timeout_s)
