"""Changes to the application's adapter set: validate on a replica, record, wait for replicas.

``register``: a replica reads and validates the files against the served model (the
same checks and content hash as a single server), the registry records name -> (path,
version) durably and bumps its revision, then we wait until every live replica applied
that revision (or ``apply_timeout_s`` passes); once every live replica has tried it, a replica
that reports it could not apply it makes the call end with ``ReplicasFailedToApply`` (HTTP 503),
and the change stays recorded. A registry actor that restarted between recording the change and
the wait is followed when it holds the change (it reloaded its manifest); one that does not (its
manifest was lost) makes the call end with ``RegistryRestarted`` (HTTP 503: retry), not a 200 for a
change that is gone. A registry actor that is gone (Ray raises ``RayActorError``: it was stopped,
or could not restart) makes the call end with ``RegistryUnavailable`` (HTTP 503), which says
whether the change was recorded; one whose call raised there (Ray raises ``RayTaskError``: e.g. it
could not write its manifest) with ``RegistryFailed`` (HTTP 500), which says so too. Blocking; call it from a worker thread (the admin routes already do).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from runtime.distributed.ray_failure import ray_failure
from runtime.engine import check_adapter_name
from runtime.lora.adapter import AdapterPathError
from runtime.lora.registry import some_names
from runtime.request import AdapterRef, UnknownAdapterError
from runtime.server.admin_workers import AdminBusy
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


class RegistryRestarted(APIError):
    """HTTP 503: the registry actor restarted between recording the change and the replicas
    applying it, and the restarted one does not hold it: either it started without its manifest
    (deleted or lost), so nothing of the change is left, or it started from its manifest and
    another admin call has changed the adapter since, which sending this change again would undo.
    The two cannot be told apart here, so the message names both and points to ``GET /v1/models``. Also
    (``again``) when it restarted more than ``RegistryClient.MAX_RESTARTS_FOLLOWED`` times during
    one call; sending the same change again is then a no-op where it is held."""

    def __init__(self, what: str, again: bool = False) -> None:
        if again:
            why = "the adapter registry kept restarting while the call waited for the replicas to apply the change; retry the request"
        else:
            why = ("the adapter registry restarted before the replicas applied the change, and the restarted registry does not hold it "
                   "(its manifest was lost, or another admin call has changed this adapter since): the change is not in effect; "
                   "check GET /v1/models before sending it again")
        super().__init__(503, f"{what}: {why}", code="registry_restarted")


class RegistryUnavailable(APIError):
    """HTTP 503: the registry actor did not answer a call of the admin call: Ray raised
    ``RayActorError`` (it was stopped, or could not be restarted; a restart from its manifest is
    waited for, the calls are retried meanwhile). ``recorded``: True when the registry had already
    recorded the change (it went while the call waited for the replicas); None when it went during
    the call that records it, so whether it did is not known."""

    def __init__(self, what: str, err: BaseException, recorded: Optional[bool]) -> None:
        gone = f"the adapter registry actor is unavailable ({type(err).__name__}: stopped, or it could not restart)"
        if recorded:
            why = (f"the change is recorded in the registry's manifest, but {gone} before every replica applied it; the replicas keep "
                   "serving the adapters they hold until a registry runs again from that manifest")
        else:
            why = (f"{gone}, so whether the change was recorded is not known (a registry started again from its manifest holds it "
                   "if it was); check GET /v1/models once the registry is back before sending it again")
        super().__init__(503, f"{what}: {why}", code="registry_unavailable")


class RegistryFailed(APIError):
    """HTTP 500 ``registry_error``: the registry actor's own call of the admin call raised there
    (Ray's ``RayTaskError``), e.g. an OSError writing adapters.json under ``--registry-dir`` (disk
    full, no permission). Ray raises it as an instance of the cause's class too, so it reached the
    admin route's handlers for the client's files: a 400 ``invalid_adapter`` whose message was the
    remote traceback. The message names the error in one line (the log has the traceback);
    ``recorded`` as for ``RegistryUnavailable``: True when the registry had recorded the change
    (it failed while the call waited for the replicas); None when the call that records it failed
    (the registry records a change once its manifest is written, so the running one did not)."""

    def __init__(self, what: str, err: BaseException, recorded: Optional[bool]) -> None:
        failed = f"the adapter registry failed ({ray_failure(err)})"
        if recorded:
            why = f"{failed} while the call waited for the replicas; the change is recorded in its manifest"
        else:
            why = (f"{failed}, and the running registry did not record the change; fix the cause (e.g. the --registry-dir "
                   "folder's disk or permissions), check GET /v1/models, then send it again")
        super().__init__(500, f"{what}: {why}", code="registry_error")


class RegistryClient:
    # How many registry restarts one admin call follows (each one a restart from its manifest that
    # still holds the change) before it gives up with ``RegistryRestarted``.
    MAX_RESTARTS_FOLLOWED = 3

    def __init__(self, registry: Any, replicas: Any, apply_timeout_s: float = 30.0) -> None:
        self.registry = registry
        self.replicas = replicas
        self.apply_timeout_s = apply_timeout_s

    def register(self, name: str, path: str, *, within: Optional[Sequence[str]] = None) -> AdapterRef:
        """``validate`` (``within`` as there), then record the adapter for every replica to apply,
        with ``within``: each replica's own read of the files is confined to it as well."""
        return self._record(name, path, self.validate(name, path, within=within), within)

    def register_all(self, adapters: Sequence[tuple[str, str]]) -> list[AdapterRef]:
        """``register`` each (name, path), all or nothing as far as validation goes: every adapter
        is validated by a replica before the first is recorded, so one bad entry records none."""
        checked = [(name, path, self.validate(name, path)) for name, path in adapters]
        return [self._record(name, path, result) for name, path, result in checked]

    def validate(self, name: str, path: str, *, within: Optional[Sequence[str]] = None) -> dict[str, Any]:
        """A replica reads and validates the adapter (nothing recorded): {version, max_rank}, or
        ValueError (``AdapterPathError`` when the read was refused for where the files resolve, the
        admin route's 403 ``path_not_allowed`` as on a single server), or the OSError the read failed
        with (errno, strerror and filename as the replica had them: the admin route's 400 "cannot
        read FILE: Permission denied", as on a single server); the name is checked here
        first as a single server checks it (``check_adapter_name``: TypeError for a non-str,
        ValueError for an empty, padded or reserved one). ``within``: the
        folders that read must stay in (``LLMEngine.load_adapter_files``); ``register`` records
        them, so the replicas' own reads when they apply the change stay in them too. ``AdminBusy`` (the
        admin route's 429) when the replica has too many validations in progress. An ``APIError`` 503
        ``replica_unavailable`` when that replica dies before it answers (Serve replaces it; a retry
        goes to a live one), or whose engine is gone (it answers so; Serve replaces it): nothing was recorded."""
        check_adapter_name(name)
        confined = {"within": [str(r) for r in within]} if within is not None else {}
        try:
            checked = self.replicas.validate_adapter.remote(name, str(path), **confined).result()
        except RayActorError as err:  # not a bug here: a 500 would say so
            raise APIError(503, f"load {name!r}: the replica validating the files stopped before it answered ({type(err).__name__}); "
                                "nothing was recorded; retry the request", code="replica_unavailable") from err  # fmt: skip
        if "busy" in checked:
            raise AdminBusy(checked["busy"])
        if checked.get("kind") == "engine_dead":
            raise APIError(503, f"load {name!r}: the replica validating the files cannot read them, its engine is gone ({checked['error']}); "
                                "nothing was recorded; retry the request", code="replica_unavailable")  # fmt: skip
        if checked.get("kind") == "os" and checked.get("strerror") is not None:  # e.g. PermissionError, as OSError builds it from errno
            raise OSError(checked.get("errno"), checked["strerror"], checked.get("filename"))
        if "error" in checked:
            raise (AdapterPathError if checked.get("kind") == "path" else ValueError)(checked["error"])
        return checked

    def _ask(self, call: Any, what: str, recorded: Optional[bool]) -> Any:
        """``ray.get(call)``, a call to the registry actor made for ``what``; ``RegistryUnavailable``
        (``recorded`` says what it knows of the change) when that actor is gone: Ray's RayActorError
        came out of the admin route as a 500 ``internal_error``, as if lorafleet had a bug;
        ``RegistryFailed`` when the call raised in the actor (logged with the remote traceback)."""
        try:
            return ray.get(call)
        except RayActorError as err:
            raise RegistryUnavailable(what, err, recorded) from err
        except RayTaskError as err:  # before any handler of the cause's class (an OSError's: "cannot read" the client's files)
            logger.error("%s: the adapter registry's call failed: %s", what, err)
            raise RegistryFailed(what, err, recorded) from err

    def _record(self, name: str, path: str, checked: dict[str, Any], within: Optional[Sequence[str]] = None) -> AdapterRef:
        """Record the validated adapter, then wait for the replicas (``_wait``). A registry that
        restarted meanwhile holds this change only if its entry has the same version, path and
        ``within``: the registry records a load again with other roots as a change of its own
        (``AdapterRegistryService.register``), so an entry with other roots, left by another admin
        call, is not this one, and waiting on it answered 200 for confinement not in effect."""
        what = f"register {name}@{checked['version']}"
        roots = [str(r) for r in within] if within is not None else None
        confined = {"within": roots} if roots is not None else {}
        result = self._ask(self.registry.register.remote(name, str(path), checked["version"], checked["max_rank"], **confined), what,
                           recorded=None)
        wanted = (checked["version"], str(path), roots)
        self._wait(result, what, name, lambda entry: entry is not None and (entry["version"], entry["path"], entry.get("within")) == wanted)
        return AdapterRef(name, checked["version"])

    def unregister(self, name: str) -> None:
        what = f"unregister {name}"
        result = self._ask(self.registry.unregister.remote(name), what, recorded=None)
        if result is None:
            try:
                registered = "; registered: " + some_names(e["name"] for e in ray.get(self.registry.state.remote())["entries"])
            except RayActorError:  # it answered that the name is not registered: that answer stands
                registered = ""
            raise UnknownAdapterError(f"adapter {name!r} is not registered{registered}")
        self._wait(result, what, name, lambda entry: entry is None)

    def _wait(self, recorded: dict[str, Any], what: str, name: str, holds: Callable[[Optional[dict[str, Any]]], bool]) -> None:
        """Wait for the live replicas to apply ``recorded`` ({revision, registry}: what the change
        returned). ``holds(entry)``: whether a registry whose entry for ``name`` is ``entry`` (None:
        not registered) holds the change.

        A revision says nothing outside the registry actor that numbered it: when the actor restarted
        since (``wait_applied`` answers with another incarnation), its state is read, and the call
        waits for its current revision if that holds the change (restarted from its manifest), else
        raises ``RegistryRestarted`` (its manifest was lost: the change is not there, and waiting
        for the old revision number would wait for another set)."""
        revision, registry = recorded["revision"], recorded["registry"]
        for _ in range(self.MAX_RESTARTS_FOLLOWED + 1):
            report = self._ask(self.registry.wait_applied.remote(revision, self.apply_timeout_s, registry=registry), what, recorded=True)
            if report["registry"] == registry:
                break
            state = self._ask(self.registry.state.remote(), what, recorded=True)
            if not holds(next((e for e in state["entries"] if e["name"] == name), None)):
                raise RegistryRestarted(what)
            revision, registry = state["revision"], state["registry"]
        else:
            raise RegistryRestarted(what, again=True)
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
