"""Changes to the application's adapter set: validate on a replica, record, wait for replicas.

``register``: a replica reads and validates the files against the served model (the
same checks and content hash as a single server), the registry records name -> (path,
version) durably and bumps its revision, then we wait until every live replica applied
that revision (or ``apply_timeout_s`` passes); once every live replica has tried it, a replica
that reports it could not apply it makes the call end with ``ReplicasFailedToApply`` (HTTP 503),
and the change stays recorded. Blocking; call it from a worker thread (the admin routes already do).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import ray

from runtime.engine import check_adapter_name
from runtime.lora.registry import some_names
from runtime.request import AdapterRef, UnknownAdapterError
from runtime.server.errors import APIError

logger = logging.getLogger("lorafleet.registry")


class ReplicasFailedToApply(APIError):
    """HTTP 503: live replica(s) could not apply the change (the files are not visible on their
    node yet, or changed on disk since they were validated). The change is recorded; those
    replicas retry at their syncs (at once when the files change, ``apply_backoff``), and
    meanwhile serve the name only if they already hold the registered version. Posting the
    same load again waits for them once more and answers with how they stand then."""

    def __init__(self, what: str, name: str, failed: dict[str, list[str]]) -> None:
        detail = "; ".join(f"replica {rid}: {' | '.join(errs)}" for rid, errs in sorted(failed.items()))
        super().__init__(
            503,
            f"{what}: recorded in the registry, but {len(failed)} replica(s) failed to apply it; they retry at their syncs (at once when the files change), "
            f"and meanwhile serve {name!r} only if they already hold the registered version (post the same request again "
            f"to check): {detail}",
            code="replicas_failed_to_apply",
        )
        self.failed = failed


class RegistryClient:
    def __init__(self, registry: Any, replicas: Any, apply_timeout_s: float = 30.0) -> None:
        self.registry = registry
        self.replicas = replicas
        self.apply_timeout_s = apply_timeout_s

    def register(self, name: str, path: str) -> AdapterRef:
        return self._record(name, path, self.validate(name, path))

    def register_all(self, adapters: Sequence[tuple[str, str]]) -> list[AdapterRef]:
        """``register`` each (name, path), all or nothing as far as validation goes: every adapter
        is validated by a replica before the first is recorded, so one bad entry records none."""
        checked = [(name, path, self.validate(name, path)) for name, path in adapters]
        return [self._record(name, path, result) for name, path, result in checked]

    def validate(self, name: str, path: str) -> dict[str, Any]:
        """A replica reads and validates the adapter (nothing recorded): {version, max_rank}, or
        ValueError; the name is checked here first as a single server checks it (``check_adapter_name``:
        TypeError for a non-str, ValueError for an empty, padded or reserved one)."""
        check_adapter_name(name)
        checked = self.replicas.validate_adapter.remote(name, str(path)).result()
        if "error" in checked:
            raise ValueError(checked["error"])
        return checked

    def _record(self, name: str, path: str, checked: dict[str, Any]) -> AdapterRef:
        result = ray.get(self.registry.register.remote(name, str(path), checked["version"], checked["max_rank"]))
        self._wait(result["revision"], f"register {name}@{checked['version']}", name)
        return AdapterRef(name, checked["version"])

    def unregister(self, name: str) -> None:
        revision = ray.get(self.registry.unregister.remote(name))
        if revision is None:
            registered = some_names(e["name"] for e in ray.get(self.registry.state.remote())["entries"])
            raise UnknownAdapterError(f"adapter {name!r} is not registered; registered: {registered}")
        self._wait(revision, f"unregister {name}", name)

    def _wait(self, revision: int, what: str, name: str) -> None:
        report = ray.get(self.registry.wait_applied.remote(revision, self.apply_timeout_s))
        failed = {rid: [e for e in errs if e.startswith(f"{name}: ")] for rid, errs in report["errors"].items()}
        failed = {rid: errs for rid, errs in failed.items() if errs}
        if failed:
            raise ReplicasFailedToApply(what, name, failed)
        if report["lagging"]:
            # Recorded durably; lagging replicas apply it on their next heartbeat. A request
            # reaching one before that carries the ingress's revision (refreshed right after a
            # successful call, else by the ingress's 0.5 s refresh loop), and the replica syncs
            # first (LoraReplica._catch_up). Say so instead of failing.
            logger.warning("%s: replicas %s had not applied revision %d after %.0fs", what, report["lagging"], revision, self.apply_timeout_s)
