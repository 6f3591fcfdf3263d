"""The application's one adapter registry: name -> (path, version), with a revision number.

Runs as one named Ray actor per application (see ``application.py``); replicas sync
from it and the ingress writes to it. Every change bumps ``revision`` and is written to
the manifest *before* it becomes visible, so what replicas apply is always durable.

Replicas call ``heartbeat(replica_id, applied_revision, snapshot, errors,
attempted_revision, report_base, registry)`` every ``sync_interval`` seconds: it records that they are alive,
which revision they have applied in full, which one they tried (and what failed), and
their engine snapshot (for /metrics; its per-adapter maps sent as changes to the one held,
``report_delta.py``), and returns ``{"state", "drain_s", "report", "fold"}``: the registered
set when they are behind (else None), and, once the application began shutting down
(``begin_drain``), how long their requests in flight may still run (else None); which report
it holds; which adapters' counters to fold (``fold_adapter_counters``, asked by the ingress's
/metrics). A replica whose entries failed stays behind, so it is sent the set again at every
heartbeat, and retries them (reading their files only when ``ApplyBackoff`` says it is due).
A replica is *live* while its last heartbeat is younger than ``live_after_s``.
``wait_applied(R)`` returns once every live replica has applied a revision >= R or reported
errors for one, or at the timeout with the lagging replicas named; at once when R is of another
registry actor (``register``/``unregister`` return their revision with this actor's incarnation).

The ingress refreshes its copy of the registered set twice a second (``view(known)``), with the
(registry, revision) it holds: when this actor is that registry at that revision, the reply
carries no entry (the set is unchanged; ``registry`` is this actor's incarnation, so a
restarted actor sends it whole once). The replicas' reports, for /metrics, are fetched only when
it is scraped (``replica_snapshots``), with None for a live replica whose report this actor
does not hold yet (a restarted actor refused its change-only report, and the whole one has not
come in): the ingress keeps the last one it had, so no counter seems to go back.

Version rules are the single server's: re-registering a name with other content is a
hot update (a new version; requests in flight finish on the old one, each replica's
engine keeps it until its last reader is done); registering identical content is a
no-op; unregistering removes the name for new requests.

``ready`` (in ``view()``): False while ``deploy`` registers the initial adapters (it sets
it, ``set_ready``); the ingress answers 503 meanwhile. Not persisted: a restarted actor,
or one created by someone else than ``deploy``, is ready.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from runtime.distributed.manifest import Manifest, ManifestEntry, ManifestStore
from runtime.distributed.report_delta import apply_report
from runtime.distributed.shutdown_timeouts import check_shutdown_timeouts


@dataclass
class ReplicaStatus:
    """What a replica's last heartbeat said: ``applied_revision`` was applied in full;
    ``attempted_revision`` was applied except for the entries named in ``errors``."""

    applied_revision: int
    last_seen: float
    snapshot: dict[str, Any]
    errors: tuple[str, ...] = ()
    first_seen: float = field(default_factory=time.monotonic)
    attempted_revision: int = -1
    report_number: Optional[int] = None  # which of the replica's reports ``snapshot`` is (``report_delta``); None: none yet
    fold: set[str] = field(default_factory=set)  # adapter names its next heartbeat is asked to fold (``fold_adapter_counters``)

    def settled(self, revision: int) -> bool:
        """Done with ``revision``: applied it, or tried and reported what failed."""
        return self.applied_revision >= revision or (self.attempted_revision >= revision and bool(self.errors))


# The registry actor's calls as this lorafleet makes them (their names, arguments and answers).
# The actor is detached: one started by an earlier lorafleet can still run when a newer one
# deploys, and ``start_registry`` refuses it unless its ``protocol()`` is this number. Bump it
# with any change that a caller of the previous version's actor would trip over (e.g. a new
# argument: ``register(..., within=...)`` was a TypeError, an admin load's 500, on an actor
# from before it). Actors from before ``protocol()`` existed count as 1.
REGISTRY_PROTOCOL = 2


class AdapterRegistryService:
    # A replica silent this many times ``live_after_s`` (at least a minute) is dropped from
    # ``replicas``: one that died without its goodbye (``forget``) would otherwise stay there, and
    # a long-lived actor would collect one entry, snapshot included, per crashed replica. It is
    # not live long before that, and a replica that comes back is recorded again by its heartbeat.
    FORGET_AFTER_LIVE = 30

    def __init__(self, registry_dir: str, live_after_s: float = 2.0) -> None:
        self.store = ManifestStore(registry_dir)
        self.manifest: Manifest = self.store.load()
        self.live_after_s = live_after_s
        self.forget_after_s = max(60.0, self.FORGET_AFTER_LIVE * live_after_s)
        self.replicas: dict[str, ReplicaStatus] = {}
        self.ready = True
        self.incarnation = uuid.uuid4().hex  # which actor answers: a restarted one holds no report, and is sent views whole once
        self.drain_deadline: Optional[float] = None  # time.monotonic() when the drain ends; None: not shutting down

    # ---- the registered set --------------------------------------------------------------------
    def protocol(self) -> int:
        """``REGISTRY_PROTOCOL`` of the lorafleet this actor runs (``start_registry`` compares it)."""
        return REGISTRY_PROTOCOL

    def folder(self) -> str:
        """The manifest's folder (resolved): the ``registry_dir`` this actor was created with."""
        return str(self.store.folder)

    def state(self) -> dict[str, Any]:
        """The registered set: {"revision", "entries", "registry": ``incarnation``, the actor whose
        revision sequence "revision" belongs to (a replica reports it back: ``heartbeat``)}."""
        return {"revision": self.manifest.revision, "entries": [vars_of(e) for e in self.manifest.entries], "registry": self.incarnation}

    def register(self, name: str, path: str, version: str, max_rank: int, within: Optional[Sequence[str]] = None) -> dict[str, Any]:
        """Record ``name`` at ``version``; returns {revision, previous_version, changed, registry}
        (``registry``: this actor's incarnation, whose sequence ``revision`` is of: ``wait_applied``).
        ``within``: the folders the validating read was confined to (the admin route's
        ``--adapter-root``), recorded so that every replica's read of ``path`` is confined to them
        too (``LoraReplica._apply_entry``); None: not confined."""
        confined = tuple(str(r) for r in within) if within is not None else None
        current = self.manifest.by_name()
        previous = current.get(name)
        if previous is not None and (previous.version, previous.path, previous.within) == (version, path, confined):
            return {"revision": self.manifest.revision, "previous_version": version, "changed": False, "registry": self.incarnation}
        current[name] = ManifestEntry(name, path, version, max_rank, time.time(), confined)
        self._commit(current)
        return {"revision": self.manifest.revision, "previous_version": previous.version if previous else None, "changed": True,
                "registry": self.incarnation}

    def unregister(self, name: str) -> Optional[dict[str, Any]]:
        """Remove ``name``; returns {revision, registry} (as ``register``), or None when the name is
        not registered."""
        current = self.manifest.by_name()
        if current.pop(name, None) is None:
            return None
        self._commit(current)
        return {"revision": self.manifest.revision, "registry": self.incarnation}

    def _commit(self, entries: dict[str, ManifestEntry]) -> None:
        manifest = Manifest(self.manifest.revision + 1, tuple(sorted(entries.values(), key=lambda e: e.name)))
        self.store.save(manifest)  # durable first: a crash after this line loses nothing
        self.manifest = manifest

    # ---- replicas --------------------------------------------------------------------------------
    def heartbeat(
        self,
        replica_id: str,
        applied_revision: int,
        snapshot: dict[str, Any],
        errors: tuple[str, ...] = (),
        attempted_revision: Optional[int] = None,
        report_base: Optional[int] = None,
        registry: Optional[str] = None,
    ) -> dict[str, Any]:
        """Record a replica's progress; returns {"state": ``state()`` when it is behind, else
        None, "drain_s": ``drain_left()``, "report": the number of the replica's report held now,
        or None when ``snapshot`` could not be taken, "fold": the names ``fold_adapter_counters``
        asked this replica to fold since its last heartbeat}.

        ``report_base``: None when ``snapshot`` is the whole report; else its maps are changes to
        the replica's report of that number (``report_delta``), refused (``"report": None``, the
        report held stays) unless that is the one held.

        A replica whose entries failed stays behind (``applied_revision`` does not advance),
        so it gets the state again at every heartbeat and retries them.

        ``registry``: the incarnation whose ``state()`` the replica's revisions come from (None:
        not said). Revisions of another registry actor, or past this one's revision, say nothing
        of this actor's sequence (it restarted; from a lost or deleted manifest it starts again
        lower, and its revision 3 need not be the set another actor's revision 3 was): such a
        replica counts as having applied nothing (-1), so it is sent the state and
        ``wait_applied`` waits for it to apply it.
        """
        now = time.monotonic()
        for rid in [rid for rid, s in self.replicas.items() if now - s.last_seen > self.forget_after_s]:
            del self.replicas[rid]
        reported = max(applied_revision, attempted_revision if attempted_revision is not None else -1)
        if (registry is not None and registry != self.incarnation) or reported > self.manifest.revision:
            applied_revision, attempted_revision, errors = -1, -1, ()
        attempted = max(applied_revision, attempted_revision if attempted_revision is not None else applied_revision)
        status = self.replicas.get(replica_id)
        if status is None:
            status = self.replicas[replica_id] = ReplicaStatus(applied_revision, now, {}, tuple(errors), attempted_revision=attempted)
        else:
            status.applied_revision, status.last_seen, status.errors = applied_revision, now, tuple(errors)
            status.attempted_revision = attempted
        report = apply_report(status.snapshot, snapshot, report_base, status.report_number)
        if report is not None:
            status.snapshot, status.report_number = report, (status.report_number or 0) + 1
        fold: list[str] = []
        if report is not None:  # a refused report is sent again whole at once: that reply carries them
            fold, status.fold = sorted(status.fold), set()
        return {"state": self.state() if applied_revision < self.manifest.revision else None, "drain_s": self.drain_left(),
                "report": status.report_number if report is not None else None, "fold": fold}

    def fold_adapter_counters(self, folds: dict[str, list[str]]) -> None:
        """The ingress's /metrics counts, for each replica id of ``folds``, those names under
        ``__other__``: that replica's next heartbeat's reply asks it to fold their counters
        (``LoraReplica._heartbeat``). Replicas this actor does not know are skipped (the ingress's
        next scrape asks again)."""
        for replica_id, names in folds.items():
            status = self.replicas.get(replica_id)
            if status is not None:
                status.fold.update(names)

    # ---- start and shutdown ------------------------------------------------------------------------
    def set_ready(self, ready: bool) -> None:
        self.ready = bool(ready)

    def begin_deploy(self) -> None:
        """A new ``deploy`` starts: not ready until it says so, and no drain. The actor is detached
        and outlives applications: a start that never finished, or a drain whose ``stop`` never
        ran, must not hold the next deployment at 503 or shut its engines down."""
        self.ready = False
        self.drain_deadline = None

    def begin_drain(self, drain_s: float) -> None:
        """The application is shutting down: replicas learn it at their next heartbeat, and let
        their requests in flight run for what is left of ``drain_s`` (the first call sets it).

        ValueError (``check_shutdown_timeouts``), nothing begun, for a ``drain_s`` that is negative,
        NaN, or does not end, with the step grace, inside the replicas' graceful shutdown timeout.
        ``LoraIngress.begin_shutdown`` checks it before calling this, but the actor is a named one
        that a script can call directly: a negative or NaN drain was taken as none at all (the
        requests in flight cut at once), and one too long for Serve's timeout had Serve kill the
        replicas while their requests still ran, before the drain could end them with a 503."""
        check_shutdown_timeouts(drain_s)
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + float(drain_s)

    def drain_left(self) -> Optional[float]:
        """Seconds the replicas' requests in flight may still run; None while not shutting down."""
        return None if self.drain_deadline is None else max(0.0, self.drain_deadline - time.monotonic())

    def forget(self, replica_id: str) -> None:
        """A replica shutting down says goodbye, so waits need not time it out."""
        self.replicas.pop(replica_id, None)

    def _live(self) -> dict[str, ReplicaStatus]:
        now = time.monotonic()
        return {rid: s for rid, s in sorted(self.replicas.items()) if now - s.last_seen <= self.live_after_s}

    def live_replicas(self) -> dict[str, dict[str, Any]]:
        """Live replica id -> {"applied_revision", "attempted_revision", "age_s", "snapshot",
        "errors"}. "snapshot" is the replica's last report, or None while this actor holds none
        (as in ``replica_snapshots``): an empty one would read as its counters being 0, and a sum
        over replicas taken then (``benchmarks/ray_affinity.py``'s deltas) as a reset."""
        now = time.monotonic()
        return {
            rid: {
                "applied_revision": s.applied_revision,
                "attempted_revision": s.attempted_revision,
                "age_s": now - s.last_seen,
                "snapshot": s.snapshot if s.report_number is not None else None,
                "errors": list(s.errors),
            }
            for rid, s in self._live().items()
        }

    def view(self, known: Optional[tuple[str, int]] = None) -> dict[str, Any]:
        """What the ingress caches: {"registry": ``incarnation``, "revision", "entries", "ready"}.

        ``known``: the (registry, revision) of the view the ingress holds. When that is this
        actor at its current revision, "entries" is None: the registered set is the one the
        ingress holds (a revision names one set; every change bumps it), so an idle refresh
        carries no entry however many are registered."""
        unchanged = known is not None and tuple(known) == (self.incarnation, self.manifest.revision)
        return {"registry": self.incarnation, "revision": self.manifest.revision,
                "entries": None if unchanged else self.state()["entries"], "ready": self.ready}

    def replica_snapshots(self) -> dict[str, Optional[dict[str, Any]]]:
        """Live replica id -> the report it sent last (its engine snapshot and ``registered``),
        for the ingress's /metrics; None for one whose report this actor does not hold yet (it
        restarted, and the replica's first, change-only, report was refused: the whole one
        follows in its next call). Its counters are not 0: the ingress keeps the report it had."""
        return {rid: s.snapshot if s.report_number is not None else None for rid, s in self._live().items()}

    async def wait_applied(self, revision: int, timeout_s: float, poll_s: float = 0.02, registry: Optional[str] = None) -> dict[str, Any]:
        """Wait until every live replica is done with ``revision``: applied it, or tried and
        reported errors (those are returned at once, not after the timeout).

        Returns {applied, lagging, errors, registry}: replicas that applied it, replicas that had
        not tried it by the timeout, replica -> errors of its attempt at ``revision`` or later, and
        this actor's incarnation. ``registry``: the incarnation ``revision`` is of (None: this one);
        when that is another actor (this one restarted since: its revision sequence is another,
        and may not hold the change), it returns at once, with nothing applied, so the caller can
        check what this actor holds (``RegistryClient``).
        """
        if registry is not None and registry != self.incarnation:
            return {"applied": [], "lagging": [], "errors": {}, "registry": self.incarnation}
        deadline = time.monotonic() + timeout_s
        while True:
            live = self._live()
            lagging = sorted(rid for rid, s in live.items() if not s.settled(revision))
            if not lagging or time.monotonic() >= deadline:
                return {
                    "applied": sorted(rid for rid, s in live.items() if s.applied_revision >= revision),
                    "lagging": lagging,
                    "errors": {rid: list(s.errors) for rid, s in live.items() if s.errors and s.attempted_revision >= revision},
                    "registry": self.incarnation,
                }
            await asyncio.sleep(poll_s)


def vars_of(entry: ManifestEntry) -> dict[str, Any]:
    """An entry as replicas and the ingress get it; "within" is None when no confinement is recorded."""
    return {"name": entry.name, "path": entry.path, "version": entry.version, "max_rank": entry.max_rank, "registered_at": entry.registered_at,
            "within": list(entry.within) if entry.within is not None else None}
