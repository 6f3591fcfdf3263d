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
applies newer revisions, and reports the engine snapshot for /metrics. An entry is
installed only once its files hash to the registered version; one that cannot be
applied keeps the revision unapplied (retried at the heartbeats, its files read again once
its folder changes or a backoff passes: ``apply_backoff.py``), and the name is not
served meanwhile unless the replica already holds the registered version. A request
carries the registry revision the ingress knows and the version it names for the adapter; a
replica behind that revision syncs first, and if it cannot, serves the adapter only in that version.
Revisions are compared within one registry actor only (``registry_id``): a restarted registry
may start its sequence again lower (its manifest lost), so a replica synced with another one is
behind whatever the numbers say.

Shutdown: once the registry says the application is draining (a heartbeat's ``drain_s``),
the replica shuts its engine down as a single server does at SIGTERM: no new request,
those in flight run for ``drain_s``, the rest end with a "shutdown" error (HTTP 503
``engine_unavailable`` at the ingress). Serve deletes the replica after that.

Wire format of ``generate``: a stream of tuples, so that admission errors cross the
process boundary as data, not as pickled exception classes:
    ("out", RequestOutput, RequestMetrics | None)   metrics with the final output
    ("error", kind, message)                       kind in ERROR_KINDS
Each output goes on the wire as what the stream's previous output did not have
(``on_the_wire``): ``token_ids``, ``text`` and ``logprobs`` hold only the entries added since
then, and ``prompt_token_ids`` and ``prompt_logprobs`` come with the first output only. Sent
whole, every output would carry the prompt and everything generated so far: a request's
stream would cost the square of its length in bytes and in (un)pickling, and the one ingress,
which unpickles every replica's streams, would be the bottleneck (an 8k-token prompt: ~70 KB
and ~1 ms per token). The ingress puts them back together (``off_the_wire``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import ray
from ray import serve

from runtime.async_engine import AsyncLLMEngine, EngineDeadError
from runtime.config import EngineConfig
from runtime.distributed.apply_backoff import ApplyBackoff
from runtime.distributed.log_level import apply_log_level
from runtime.distributed.registry_lookup import find_registry
from runtime.distributed.report_delta import ReportSender
from runtime.lora.adapter import AdapterPathError
from runtime.lora.registry import AdapterInfo
from runtime.request import PromptTooLongError, RequestOutput, RequestRejected, SamplingParams, UnknownAdapterError
from runtime.server.admin_workers import ADMIN_MAX_IN_PROGRESS, AdminBusy, AdminWorkers

logger = logging.getLogger("lorafleet.replica")
DRAINING = "engine is shutting down; no new requests are accepted"  # what a draining engine's own refusal says



class AdapterUnavailable(RuntimeError):
    """The adapter is registered, but this replica cannot serve the version the request needs
    (yet): the request should be retried (another replica, or a later sync, can serve it)."""


ERROR_KINDS: dict[str, type[Exception]] = {
    "unknown_adapter": UnknownAdapterError,
    "adapter_unavailable": AdapterUnavailable,
    "prompt_too_long": PromptTooLongError,
    "rejected": RequestRejected,
    "invalid": ValueError,
    "engine_dead": EngineDeadError,
}


def on_the_wire(out: RequestOutput, previous: Optional[RequestOutput]) -> RequestOutput:
    """``out`` as sent after ``previous``, the stream's last output sent (None: ``out`` is the first).

    ``token_ids``, ``text`` and ``logprobs`` become their entries past ``previous``'s (its
    ``len(token_ids)`` tokens and ``len(text)`` characters; both only grow within a stream);
    ``prompt_token_ids`` is () and ``prompt_logprobs`` None after the first output. The other
    fields (``new_token_ids``, ``new_text``, ...) are sent as they are."""
    first = previous is None
    tokens, chars = (0, 0) if previous is None else (len(previous.token_ids), len(previous.text))
    return dataclasses.replace(
        out, token_ids=out.token_ids[tokens:], text=out.text[chars:], logprobs=tuple(out.logprobs[tokens:]) if out.logprobs is not None else None,
        prompt_token_ids=out.prompt_token_ids if first else (), prompt_logprobs=out.prompt_logprobs if first else None,
    )


def off_the_wire(wire: RequestOutput, previous: Optional[RequestOutput]) -> RequestOutput:
    """The output ``wire`` stands for (``on_the_wire``'s inverse), given ``previous``, the output
    this function returned for the stream's previous item (None: ``wire`` is the first). Its
    ``logprobs`` stay the wire's, the entries of the tokens past ``previous`` only: the ingress
    keeps the whole list itself (``replica_set.PrefixView``)."""
    if previous is None:
        return wire
    return dataclasses.replace(
        wire, token_ids=previous.token_ids + wire.token_ids, text=previous.text + wire.text,
        prompt_token_ids=previous.prompt_token_ids, prompt_logprobs=previous.prompt_logprobs,
    )


def error_item(err: Exception) -> tuple[str, str, str]:
    for kind, cls in ERROR_KINDS.items():  # most specific first: ValueError subclasses precede it
        if isinstance(err, cls):
            return ("error", kind, str(err))
    raise err


def _pin_mismatch(adapter: Optional[str], here: Optional[str], pinned: str) -> str:
    holds = f"holds version {here}" if here is not None else "does not hold it"
    return f"adapter {adapter!r}: the request started on version {pinned}, and this replica {holds}"


def replica_seed(engine_seed: int, replica_id: str) -> int:
    """The engine seed of one replica: ``sha256(f"{engine_seed}:{replica_id}")``, first 62 bits.

    Every replica gets the same config; with its seed unchanged they drew the same seeds for
    requests that bring none, so the ``n`` unseeded choices of one HTTP request, spread over
    replicas, came back in identical pairs. Serve's replica ids are unique, so the streams differ."""
    digest = hashlib.sha256(f"{engine_seed}:{replica_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


@dataclass(frozen=True)
class AdapterLease:
    """What Serve's multiplexing cache holds for an adapter: its name and the version seen."""

    name: str
    version: str


class LoraReplica:
    # check_health fails once no adapter sync has succeeded for this long (other than while the
    # registry actor is away: it restarts from its manifest, and restarting replicas would not
    # help). Long enough for a slow apply (validating a large adapter on shared storage).
    SYNC_STALE_AFTER_S = 60.0
    # While an apply runs, a heartbeat this often keeps the replica live in the registry (whose
    # live_after_s is 2 s), so admin calls wait for it (``_apply_keeping_alive``).
    KEEPALIVE_S = 0.5

    async def __init__(self, engine_config: EngineConfig, registry_name: str, namespace: str, sync_interval_s: float = 0.25,
                       log_level: str = "info") -> None:
        apply_log_level(log_level)
        replica_id = serve.get_replica_context().replica_id.unique_id
        registry = await find_registry(registry_name, namespace)  # before the engine: a bounded wait, then one line (RegistryMissing)
        engine = AsyncLLMEngine(dataclasses.replace(engine_config, seed=replica_seed(engine_config.seed, replica_id)))
        engine.start()
        self._setup(engine, registry, replica_id, sync_interval_s)

        async def load_adapter(name: str) -> AdapterLease:
            return await self._lease(name)

        # Wired at init because the capacity comes from the engine config; Serve detects
        # multiplexing set up this way on the instance. (A plain function, not the bound
        # method: Serve caches its state on the decorated object.)
        self.load_adapter = serve.multiplexed(max_num_models_per_replica=engine_config.host_tier_size)(load_adapter)
        await asyncio.to_thread(self._apply, await self.registry.state.remote())
        self._sync_task = asyncio.create_task(self._sync_loop())

    def _setup(self, engine: AsyncLLMEngine, registry: Any, replica_id: str, sync_interval_s: float) -> None:
        """The replica's state around an engine and a registry handle (``__init__`` without Serve:
        tests build a replica this way, with a local registry, and call its methods directly)."""
        self.engine = engine
        self.replica_id = replica_id
        self.registry = registry
        self.sync_interval_s = sync_interval_s
        # (applied_revision, attempted_revision, apply_errors, registry_id), replaced whole: a heartbeat
        # sent while an apply runs in its thread (``_apply_keeping_alive``) must not pair one revision's
        # errors, or one registry actor's id, with another's numbers.
        self._progress: tuple[int, int, tuple[str, ...], Optional[str]] = (-1, -1, (), None)
        self._unservable: dict[str, str] = {}  # registered names this replica cannot serve yet -> why
        self._reports = ReportSender()  # heartbeats carry what changed in the per-adapter maps
        self._sync_lock = asyncio.Lock()
        self._sync_task: Optional[asyncio.Task] = None
        self._clock = time.monotonic
        self._backoff = ApplyBackoff(clock=lambda: self._clock())  # when a failed entry's files are read again
        self._sync_fine_at = self._clock()  # when the last sync succeeded, or failed only because the registry was away
        self._sync_error: Optional[str] = None  # why the last sync failed (None: it succeeded)
        # Syncs before requests (``_catch_up``) failing since the last that worked: (the kind of
        # error logged, how many failed); None: the last one worked. Logged once per kind, not per request.
        self._catch_up_failing: Optional[tuple[str, int]] = None
        self._metrics_lock = threading.Lock()
        self._finished: dict[str, Any] = {}
        # Requests this replica is streaming: only theirs are kept (an abort that lands after its
        # stream ended, from a cancelled admission, would otherwise leave an entry for ever).
        self._streaming: Counter[str] = Counter()  # a count: a refused duplicate id ends without ending the other
        self._drain: Optional[threading.Thread] = None  # the engine's shutdown, once the application began draining
        # validate_adapter's waits for the engine's file reader (one adapter at a time): a thread of their own,
        # not the event loop's default executor, which the heartbeats' snapshots and the applies use.
        self._validations = AdminWorkers(threads=1, max_in_progress=ADMIN_MAX_IN_PROGRESS)
        self.engine.add_observer(self._observe)

    # ---- the registered set ------------------------------------------------------------------
    def _apply(self, state: dict[str, Any]) -> None:
        """Make this engine's adapter set equal the registry's ``state`` (runs off the event loop).

        An entry that cannot be applied here (files not visible on this node yet, or changed
        since the registry validated them) is reported in ``apply_errors`` and keeps
        ``applied_revision`` below the state's revision, so every later sync retries it;
        ``attempted_revision`` says which revision the errors are about. A retry reads the files
        only when ``ApplyBackoff`` says it is due (the folder changed, or the backoff passed);
        until then the entry keeps its last error.
        """
        wanted = {e["name"]: e for e in state["entries"]}
        have = {a.name: a for a in self.engine.adapters()}
        failed: dict[str, str] = {}
        for name, entry in wanted.items():
            if name in have and (have[name].version, have[name].path) == (entry["version"], entry["path"]):
                continue  # same content from the same folder (another folder: re-read from there, as a single server does)
            error = self._backoff.held_error(entry)
            if error is None:
                signature = self._backoff.signature(entry["path"])  # before the read: a change made during it counts
                error = self._apply_entry(entry, have.get(name))
                if error is not None:
                    self._backoff.failed(entry, error, signature)
            if error is not None:
                failed[name] = error
        for name in set(have) - set(wanted):
            self.engine.unregister_adapter(name)
        self._backoff.keep_only(failed)
        self._record_apply(state["revision"], failed, state.get("registry"))

    def _apply_entry(self, entry: dict[str, Any], held: Optional[AdapterInfo]) -> Optional[str]:
        """Make ``entry`` current in the engine; returns why it could not (``"<name>: ..."``), else None.

        The files are read and hashed first, and installed only if they are the version the
        registry validated: otherwise nothing is installed (requests never bind to unchecked
        content), and the version held so far stays only if the registry still names it. The read
        is confined to the entry's ``within`` (the admin route's ``--adapter-root``, recorded with
        it; absent or None: not confined), as the validating replica's was: files that resolve
        outside it when opened are refused, nothing of them read. The engine's later re-reads of
        the version (host-tier misses) must find the files at the paths this read approved.
        """
        name, path, version = entry["name"], entry["path"], entry["version"]
        try:  # outside the engine lock; touches no engine state
            adapter = self.engine.load_adapter_files(name, path, within=entry.get("within"))
        except (ValueError, OSError) as err:
            problem = str(err)
        else:
            if adapter.version == version:
                self.engine.install_adapter(adapter, path)  # what was checked, not a second read of the files
                self._mark_unservable(name, None)
                return None
            # The files changed since the registry validated them: serving them would
            # give this replica different weights than the others under the same name.
            problem = f"{path} now has version {adapter.version}, registered {version}; load it again"
        if held is None or held.version != version:
            # Now, not when the whole revision is applied (other entries may take long to read): a
            # request for the name meanwhile gets a 503 to retry, not a 404 as if it were not registered.
            self._mark_unservable(name, f"{name}: {problem}")
        if held is not None and held.version != version:
            self.engine.unregister_adapter(name)  # never serve a version the registry no longer names
        return f"{name}: {problem}"

    def _mark_unservable(self, name: str, why: Optional[str]) -> None:
        """Record now whether ``name`` is servable here (``why`` None) while an apply runs; replaced
        whole, as the event loop reads it meanwhile. ``_record_apply`` sets the final set."""
        rest = {k: v for k, v in self._unservable.items() if k != name}
        self._unservable = rest if why is None else {**rest, name: why}

    @property
    def applied_revision(self) -> int:
        """The newest revision applied in full."""
        return self._progress[0]

    @property
    def attempted_revision(self) -> int:
        """The newest revision applied, in full or not (``apply_errors`` says what failed)."""
        return self._progress[1]

    @property
    def apply_errors(self) -> tuple[str, ...]:
        return self._progress[2]

    @property
    def registry_id(self) -> Optional[str]:
        """The registry actor (incarnation) whose revision sequence the two revisions above belong
        to; a restarted registry has another one, and may restart its sequence lower (None: not said)."""
        return self._progress[3]

    def has_tried(self, revision: int, registry: Optional[str] = None) -> bool:
        """Whether revision ``revision`` of registry ``registry`` (None: the one synced with) was tried
        here. A revision of another registry actor was not: its numbers are another sequence."""
        return (registry is None or registry == self.registry_id) and self.attempted_revision >= revision

    def _record_apply(self, revision: int, failed: dict[str, str], registry: Optional[str] = None) -> None:
        """Record the outcome of applying ``revision`` of ``registry``: applied only when nothing
        failed (a revision of another registry than the one before counts from scratch)."""
        self._unservable = {name: failed[name] for name in failed if name not in {a.name for a in self.engine.adapters()}}
        errors = tuple(failed[name] for name in sorted(failed))
        if errors != self.apply_errors:  # log changes, not every retry
            for e in errors:
                logger.error("replica %s: %s", self.replica_id, e)
        applied_before = self.applied_revision if registry == self.registry_id else -1
        self._progress = (applied_before if failed else revision, revision, errors, registry)

    async def _heartbeat(self) -> Optional[dict[str, Any]]:
        """Report progress to the registry; returns its state when this replica is behind.

        The report's per-adapter maps go as changes to the report the registry holds
        (``report_delta``); when it holds another one, the whole report follows at once."""
        report = await asyncio.to_thread(self.report)  # snapshot() takes the engine lock: never on the event loop
        applied, attempted, errors, registry = self._progress
        wire, base = self._reports.outgoing(report)
        try:
            reply = await self.registry.heartbeat.remote(self.replica_id, applied, wire, errors, attempted, base, registry)
            if reply.get("report") is None and base is not None:
                reply = await self.registry.heartbeat.remote(self.replica_id, applied, report, errors, attempted, None, registry)
        except BaseException:
            self._reports.forget()
            raise
        self._reports.acknowledged(report, reply.get("report"))
        if reply.get("fold"):  # names /metrics counts under __other__: fold those not registered (takes the engine lock)
            await asyncio.to_thread(self.engine.fold_adapter_counters, reply["fold"])
        if reply["drain_s"] is not None:
            self.begin_drain(reply["drain_s"])
        return reply["state"]

    def begin_drain(self, drain_s: float) -> None:
        """The application is shutting down: shut the engine down in a thread (no new requests;
        those in flight get ``drain_s`` to finish, then fail with a "shutdown" error). Once."""
        if self._drain is not None:
            return
        logger.info("replica %s: the application is shutting down; requests in flight get up to %.1f s to finish", self.replica_id, drain_s)
        self._drain = self.engine.shutdown_in_background(drain_s)

    async def _sync_once(self, unless_tried: Optional[int] = None, registry: Optional[str] = None) -> None:
        """Heartbeat, and apply the registry's state when this replica is behind it (skipped when
        revision ``unless_tried`` of ``registry`` was tried meanwhile, by a sync this one waited for)."""
        async with self._sync_lock:
            if unless_tried is not None and self.has_tried(unless_tried, registry):
                return
            attempted = None
            for _ in range(2):  # the second heartbeat acknowledges what the first one delivered
                state = await self._heartbeat()
                if state is None or state["revision"] == attempted:
                    break  # current, or this revision failed a moment ago: the next sync retries it
                await self._apply_keeping_alive(state)
                attempted = state["revision"]
            self._sync_fine_at, self._sync_error = self._clock(), None

    async def _apply_keeping_alive(self, state: dict[str, Any]) -> None:
        """``_apply`` in a thread, with a heartbeat every ``KEEPALIVE_S`` while it runs. Reading a
        large adapter can take longer than the registry's ``live_after_s``: without them this
        replica would drop out of the live set, and an admin call waiting for every live replica
        to apply the revision would return before this one had (its heartbeats say it is behind)."""
        applying = asyncio.ensure_future(asyncio.to_thread(self._apply, state))
        while True:
            done, _ = await asyncio.wait({applying}, timeout=self.KEEPALIVE_S)
            if done:
                return applying.result()
            try:
                await self._heartbeat()  # its state (this replica is behind) is being applied already
            except Exception as err:  # noqa: BLE001 - the registry may be away; the apply goes on
                logger.debug("replica %s: heartbeat while applying failed: %s", self.replica_id, err)

    async def _sync_loop(self) -> None:
        """Sync every ``sync_interval_s`` until cancelled. A failed sync is logged and retried at
        the next tick; ``check_health`` fails if that lasts (see ``SYNC_STALE_AFTER_S``).

        Ends, with one WARNING line, once the engine refuses with ``EngineDeadError``: it is gone
        (shut down, e.g. after a drain that gave up on a stuck step, whose lock refuses every
        snapshot; or its step failed, and it refuses adapter changes), so there is nothing to apply
        or report; Serve deletes the replica next."""
        while True:
            try:
                await self._sync_once()
            except EngineDeadError as err:  # not a sync failure: no later tick can succeed
                self._sync_error = f"the engine is gone: {err}"
                logger.warning("replica %s: its engine is gone (%s); adapter syncs and reports to the registry stop", self.replica_id, err)
                return
            except ray.exceptions.RayActorError as err:  # the registry restarts from its manifest; keep serving
                self._sync_failed(f"registry unavailable: {err}", registry_away=True)
            except Exception as err:  # noqa: BLE001 - whatever it is, a later tick may succeed
                self._sync_failed(f"{type(err).__name__}: {err}", registry_away=False, exc=err)
            await asyncio.sleep(self.sync_interval_s)

    def _sync_failed(self, error: str, registry_away: bool, exc: Optional[Exception] = None) -> None:
        if error != self._sync_error:  # log changes, not every tick
            if registry_away:
                logger.warning("replica %s: %s; retrying", self.replica_id, error)
            else:
                logger.error("replica %s: adapter sync failed (%s); retrying", self.replica_id, error, exc_info=exc)
        self._sync_error = error
        if registry_away:  # not this replica's fault, and a restart would not help
            self._sync_fine_at = self._clock()

    def sync_problem(self) -> Optional[str]:
        """Why this replica's adapter set may be frozen: the sync task ended, or no sync has
        succeeded for ``SYNC_STALE_AFTER_S`` (time the registry was away excepted); else None."""
        task = self._sync_task
        if task is not None and task.done():
            why = "cancelled" if task.cancelled() else repr(task.exception()) if task.exception() is not None else self._sync_error
            return f"the adapter sync task ended ({why}); the adapter set would stay frozen"
        stale_s = self._clock() - self._sync_fine_at
        if stale_s > self.SYNC_STALE_AFTER_S:
            return f"no adapter sync succeeded for {stale_s:.0f}s (last error: {self._sync_error or 'none, a sync has been running all along'})"
        return None

    def report(self) -> dict[str, Any]:
        """The engine snapshot plus ``registered`` (name -> version), so the registry shows who holds what."""
        snap = self.engine.snapshot()
        snap["registered"] = {a.name: a.version for a in self.engine.adapters()}
        return snap

    async def _lease(self, name: str) -> AdapterLease:
        """Serve's multiplexed loader: make sure ``name`` is registered here (syncing if needed).

        Serve calls it only for names its cache does not hold; ``generate`` checks the rest.
        EngineDeadError when the sync finds this replica's engine gone (``generate`` answers it as
        ``engine_dead``, as any request that reaches the engine there), else AdapterUnavailable when
        the sync fails (the registry is away).
        """
        info = self._held(name)
        if info is None:
            try:
                await self._sync_once()
            except EngineDeadError:  # this replica's engine is gone, not the registry: refused as every request here (``_refusal``)
                raise
            except Exception as err:  # noqa: BLE001 - the registry is away: say what this replica knows
                # Raised on, the registry's RayActorError would reach the ingress as this replica's death.
                self._raise_if_unservable(name)
                raise AdapterUnavailable(f"adapter {name!r}: this replica does not hold it and cannot reach the registry "
                                         f"({type(err).__name__}: {err}); retry the request") from err  # fmt: skip
            info = self._held(name)
        if info is None:
            self._raise_if_unservable(name)
            raise UnknownAdapterError(f"adapter {name!r} is not registered in the application")
        return AdapterLease(name, info.version)

    def _held(self, name: str) -> Optional[AdapterInfo]:
        return next((a for a in self.engine.adapters() if a.name == name), None)

    def _raise_if_unservable(self, name: str) -> None:
        """A registered name whose registered version this replica failed to apply: a 503, not a 404."""
        why = self._unservable.get(name)
        if why is not None:
            raise AdapterUnavailable(f"adapter {name!r} is registered, but this replica cannot serve it yet: {why}; retry the request")

    # ---- requests ------------------------------------------------------------------------------
    def _observe(self, metrics: Any) -> None:
        with self._metrics_lock:
            if metrics.request_id in self._streaming:
                self._finished[metrics.request_id] = metrics

    async def generate(
        self,
        request_id: str,
        prompt: Any,
        params: Optional[SamplingParams],
        adapter: Optional[str],
        pinned_version: Optional[str] = None,
        min_revision: int = -1,
        expected_version: Optional[str] = None,
        min_registry: Optional[str] = None,
    ) -> AsyncIterator[tuple]:
        """Stream one request (wire format: the module docstring).

        ``min_revision``: the registry revision the ingress knows; a replica that has not yet
        tried it syncs before resolving ``adapter`` (Serve's multiplexed cache does not call
        the loader for a name it holds, so this is where a lagging replica catches up).
        ``expected_version``: the version of ``adapter`` that revision names. A replica whose
        sync fails (the registry is restarting) and stays behind ``min_revision`` serves the
        adapter only if it holds that version, else refuses (``adapter_unavailable``, retry):
        it never serves, unknowingly, a version the registry has replaced.
        ``min_registry``: the registry actor (incarnation) whose revision ``min_revision`` is; a
        replica synced with another one (the registry restarted, maybe at a lower revision) is
        behind whatever its own revision (None: compare the revisions only).

        ``pinned_version``: the request is a replay of one that already streamed tokens of
        that version of ``adapter`` on a replica that died, or one of an HTTP request's
        prompts and choices, pinned to their group's version (``replica_set.VersionGroup``);
        it runs only on that version (else an ``adapter_unavailable`` error), so its output,
        and its request's, never mix two versions.
        """
        if adapter is not None:
            refusal = self._dead_refusal()
            if refusal is None:
                behind = await self._catch_up(min_revision, min_registry)
                refusal = self._stale_refusal(adapter, behind, expected_version) or await self._refusal(adapter, pinned_version)
            if refusal is not None:
                yield refusal
                return
        with self._metrics_lock:
            self._streaming[request_id] += 1
        stream = self.engine.generate(request_id, prompt, params, adapter)
        sent: Optional[RequestOutput] = None  # the last output sent (on_the_wire sends what it lacks)
        try:
            async for out in stream:
                if pinned_version is not None and (out.adapter is None or out.adapter.version != pinned_version):
                    # A hot update landed between the check above and the admission.
                    yield error_item(AdapterUnavailable(_pin_mismatch(adapter, out.adapter.version if out.adapter else None, pinned_version)))
                    return
                metrics = None
                if out.finished:
                    with self._metrics_lock:
                        metrics = self._finished.pop(request_id, None)
                yield ("out", on_the_wire(out, sent), metrics)
                sent = out
        except (ValueError, EngineDeadError) as err:  # admission errors, raised before the first output
            yield error_item(err)
        finally:
            await stream.aclose()  # aborts the engine request if the caller went away
            with self._metrics_lock:
                self._streaming[request_id] -= 1
                if self._streaming[request_id] <= 0:
                    del self._streaming[request_id]
                    self._finished.pop(request_id, None)

    def _dead_refusal(self) -> Optional[tuple]:
        """The ``engine_dead`` error item (the message the engine's own refusal gives: its
        ``dead_error``, else that it is shutting down) for a request on a replica whose engine is
        gone (shut down, or its step failed) or draining (``begin_drain``), else None.

        Checked before the syncs a request may need (``_catch_up``, Serve's loader ``_lease``): they
        cannot help, the engine refuses the request anyway, and on an engine that was shut down no
        apply ever completes, so every request was behind and cost a registry round trip or two
        before it was refused. And before the adapter's lookup, as the engine itself checks
        (``AsyncLLMEngine._check``): a draining replica answered a name it did not hold, and the
        registry no longer had, with ``unknown_adapter`` (a 404) where a single server's draining
        engine refuses any request with a 503. Logged once (``_catch_up_failed``)."""
        if self.engine.accepting and self._drain is None:
            return None
        err = EngineDeadError(self.engine.dead_error or DRAINING)
        self._catch_up_failed(err)
        return error_item(err)

    async def _catch_up(self, revision: int, registry: Optional[str] = None) -> Optional[str]:
        """Sync now if this replica has not tried ``revision`` of ``registry`` yet. Returns why it is
        still behind it (the sync failed; the sync loop retries, and check_health reports it if it
        lasts), or None once it has tried it."""
        if self.has_tried(revision, registry):
            return None
        try:
            await self._sync_once(unless_tried=revision, registry=registry)
        except Exception as err:  # noqa: BLE001 - the request is still served, from the current set where it is current
            self._catch_up_failed(err)
            return f"its sync failed: {type(err).__name__}: {err}"
        if self._catch_up_failing is not None:
            logger.info("replica %s: syncs before requests work again (%d failed)", self.replica_id, self._catch_up_failing[1])
            self._catch_up_failing = None
        return None if self.has_tried(revision, registry) else f"revision {revision} is not in the registry it reached"

    def _catch_up_failed(self, err: Exception) -> None:
        """Log a failed sync before a request once per kind of error until such a sync works again
        (``_catch_up`` then says how many failed), not once per request: under load, a replica
        whose engine is gone, or that cannot reach the registry, got one request after another
        behind the ingress's revision, and logged a line for each."""
        kind = type(err).__name__
        failing = self._catch_up_failing
        if failing is None or failing[0] != kind:
            if isinstance(err, EngineDeadError):
                gone = "its engine is gone" if self.engine.dead_error is not None else "it is shutting down"
                logger.warning("replica %s: %s (%s); requests that reach it are refused", self.replica_id, gone, err)
            else:
                logger.warning("replica %s: sync before a request failed (%s: %s); serving the adapters it holds in their current version "
                               "(not logged again for each request until such a sync works)", self.replica_id, kind, err)  # fmt: skip
        self._catch_up_failing = (kind, (failing[1] if failing is not None else 0) + 1)

    def _stale_refusal(self, adapter: str, behind: Optional[str], expected_version: Optional[str]) -> Optional[tuple]:
        """The error item refusing ``adapter`` on a replica that is ``behind`` the ingress's revision
        and does not hold ``expected_version`` of it, the version that revision names; else None."""
        if behind is None or expected_version is None:
            return None
        held = self._held(adapter)
        if held is not None and held.version == expected_version:
            return None
        holds = f"holds version {held.version}" if held is not None else "does not hold it"
        return error_item(AdapterUnavailable(f"adapter {adapter!r}: the registry names version {expected_version}, and this replica {holds} "
                                             f"and has not caught up ({behind}); retry the request"))  # fmt: skip

    async def _refusal(self, adapter: str, pinned_version: Optional[str]) -> Optional[tuple]:
        """The error item refusing a request for ``adapter`` here, or None to admit it."""
        try:
            await self.load_adapter(adapter)
            self._raise_if_unservable(adapter)  # Serve's cache may still hold a lease on it
            held = self._held(adapter)
            if pinned_version is not None and (held is None or held.version != pinned_version):
                raise AdapterUnavailable(_pin_mismatch(adapter, held.version if held else None, pinned_version))
        except (UnknownAdapterError, AdapterUnavailable, EngineDeadError) as err:
            return error_item(err)
        return None

    async def validate_adapter(self, name: str, path: str, within: Optional[list[str]] = None) -> dict[str, Any]:
        """Read and validate adapter files against this replica's model; engine state is untouched.
        ``within``: as ``LLMEngine.load_adapter_files``'s. {"version", "max_rank"}, {"error"} for
        files that do not validate (with {"kind": "path"} when the read was refused for where the
        files resolve, ``AdapterPathError``: the admin route's 403, as on a single server; with
        {"kind": "os", "errno", "strerror", "filename"} for files that could not be read, an
        OSError, which ``RegistryClient.validate`` raises again for the admin route's message; with
        {"kind": "engine_dead"} when this replica's engine is gone, so nothing could be read: a 503
        to retry, another replica validates it), or {"busy"} (the admin call's 429,
        ``RegistryClient.validate``) when ``ADMIN_MAX_IN_PROGRESS`` validations are already in
        progress here.

        The wait for the engine's file reader runs on ``_validations``' one thread: on the event
        loop's default executor (``min(32, cores + 4)`` threads), each validation in progress held a
        thread that this replica's heartbeats (their engine snapshot) and applies also need, their
        number bounded only by the admin calls in progress at the ingress."""
        try:
            adapter = await self._validations.run(functools.partial(self.engine.load_adapter_files, name, path, within=within))
        except AdminBusy as err:
            return {"busy": f"replica {self.replica_id}: {err}"}
        except AdapterPathError as err:  # its class does not cross the wire: its kind does
            return {"error": str(err), "kind": "path"}
        except EngineDeadError as err:  # raised, it reached the admin route as Ray's error: the remote traceback as the message
            return {"error": f"replica {self.replica_id}: {err}", "kind": "engine_dead"}
        except OSError as err:  # its class does not cross the wire: its parts do, for the single server's message
            return {"error": str(err), "kind": "os", "errno": err.errno, "strerror": err.strerror, "filename": err.filename}
        except ValueError as err:
            return {"error": str(err)}
        return {"version": adapter.version, "max_rank": adapter.max_rank}

    def describe(self) -> dict[str, Any]:
        """What the ingress builds its app from. ``max_seq_tokens``: the most tokens one request
        can have here (max_model_len, or less when the KV pool holds less), which caps the
        default max_tokens as on a single server."""
        from runtime.server.app import sequence_token_limit

        return {"model_name": self.engine.model_name, "max_model_len": self.engine.max_model_len, "replica_id": self.replica_id,
                "seed": self.engine.config.seed, "max_seq_tokens": sequence_token_limit(self.engine),
                "log_level": logging.getLevelName(logging.getLogger("lorafleet").getEffectiveLevel())}

    def check_health(self) -> None:
        """Serve restarts a replica whose engine loop died, or whose adapter sync stopped (``sync_problem``).
        A replica draining for the application's shutdown is healthy: its engine stops on purpose."""
        if self._drain is not None:
            return
        if self.engine.dead_error is not None:
            raise RuntimeError(f"replica {self.replica_id}: {self.engine.dead_error}")
        problem = self.sync_problem()
        if problem is not None:
            raise RuntimeError(f"replica {self.replica_id}: {problem}")

    def __del__(self) -> None:
        """The replica's teardown: Serve calls it when it stops the replica (its graceful shutdown,
        ``UserCallableWrapper.call_destructor``), before the actor process ends; Python may call it
        again when the object is collected, so each step is one that can run twice."""
        task = getattr(self, "_sync_task", None)
        if task is not None:
            task.cancel()
        validations = getattr(self, "_validations", None)
        if validations is not None:  # its thread outlived the replica: drop waiting validations, let it end
            validations.shutdown()
        if getattr(self, "registry", None) is not None:
            self.registry.forget.remote(self.replica_id)
        if getattr(self, "_drain", None) is not None:
            self._drain.join(timeout=5.0)  # the engine is already shutting down
        elif getattr(self, "engine", None) is not None:
            self.engine.shutdown(timeout=5.0)
