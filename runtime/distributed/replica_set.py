"""ReplicaSetEngine: the engine interface ``create_app`` needs, served by a set of replicas.

The ingress builds the unchanged FastAPI app around this object:
  generate            -> the replica deployment, ``multiplexed_model_id=<adapter>`` (affinity)
                         or without it (``routing="adapter_blind"``: the baseline to compare)
  register/unregister -> ``RegistryClient`` (validate on a replica, record, wait for replicas)
  adapters()          -> the registered set, cached from the registry actor (refreshed every
                         ``refresh_s``, and at once after a change made through this ingress;
                         a refresh whose revision the ingress holds carries no entry)
  snapshot()          -> the sum of the replicas' engine snapshots; ``replica_snapshots()``
                         gives them one by one for /metrics' ``replica`` label (fetched from the
                         registry when called, i.e. at a scrape, not at every refresh)

Replica failure: if the replica dies before the request produced output, the request is
sent once more (Serve routes it to a live replica). If it dies after output was already
passed on, a greedy request is replayed on another replica and only the tokens not yet
passed on are emitted (greedy decoding is deterministic, and the replay is checked to
reproduce the emitted prefix). The replay is pinned to the adapter version the emitted
tokens came from: a replica holding another version (a hot update happened meanwhile)
refuses it, and the request fails with HTTP 503 rather than continue a v1 prefix on v2.
Any other request fails with HTTP 503 and a message to retry. Nothing waits forever on a dead replica: Ray fails the stream when its actor dies.

Availability (``accepting``, ``dead_error``: what /health and new requests see, as for a
single server's engine): unavailable (503 ``engine_unavailable``) while the registry is not
ready (``deploy`` is still registering the initial adapters) and once ``begin_shutdown`` was
called; a replica that dies after that fails its requests with that 503, without a retry.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence as SequenceABC
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import ray
from ray.exceptions import GetTimeoutError

from runtime.async_engine import EngineDeadError
from runtime.distributed.read_ahead import read_ahead
from runtime.distributed.registry_client import RegistryClient
from runtime.distributed.replica import ERROR_KINDS, off_the_wire
from runtime.lora.registry import AdapterInfo
from runtime.request import AdapterRef, RequestOutput, SamplingParams, TokenLogprobs
from runtime.server.errors import APIError
from runtime.stats import RequestMetrics
from runtime.tokenizer import Tokenizer

logger = logging.getLogger("lorafleet.replica_set")
ROUTINGS = ("affinity", "adapter_blind")
STARTING = "the application is starting (registering its initial adapters); retry shortly"
SHUTTING_DOWN = "engine is shutting down; no new requests are accepted"


class ReplicaUnavailable(APIError):
    """HTTP 503: the replica serving the request died; the client should retry."""

    def __init__(self, request_id: str, detail: str) -> None:
        super().__init__(503, f"request {request_id}: the replica serving it died ({detail}); retry the request", code="replica_unavailable")


def replica_error(kind: str, message: str) -> Exception:
    """The exception for a replica's ``("error", kind, message)`` item."""
    if kind == "adapter_unavailable":  # registered, but not servable there yet: the client should retry
        return APIError(503, message, param="model", code="adapter_unavailable")
    return ERROR_KINDS[kind](message)


class ReplicaSetEngine:
    # How long a /metrics scrape waits for the registry's snapshots before it shows the last ones
    # fetched (the registry may be restarting: its calls are retried until it is back).
    SNAPSHOT_TIMEOUT_S = 2.0
    # How many registry incarnations left (one per registry restart) ``_take`` keeps refusing, the
    # most recent ones. A late reply of a registry left is one it sent just before it died, so it
    # arrives within moments of the restart; this many restarts take far longer. Unbounded, a
    # long-lived ingress kept one id per restart for ever.
    LEFT_REGISTRIES_KEPT = 16

    def __init__(
        self,
        replicas: Any,
        registry: Any,
        model_dir: str,
        model_name: str,
        max_model_len: int,
        routing: str = "affinity",
        apply_timeout_s: float = 30.0,
        refresh_s: float = 0.5,
        max_seq_tokens: Optional[int] = None,
    ) -> None:
        """``max_seq_tokens``: the most tokens one request can have on a replica (its
        ``describe()``), which the app caps default max_tokens to; None: max_model_len."""
        if routing not in ROUTINGS:
            raise ValueError(f"routing: {routing!r} is not one of {', '.join(ROUTINGS)}")
        self.replicas = replicas
        self.registry = registry
        self.client = RegistryClient(registry, replicas, apply_timeout_s)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_seq_tokens = max_seq_tokens
        self.tokenizer = Tokenizer(model_dir)
        self.routing = routing
        self.refresh_s = refresh_s
        self._observers: list[Callable[[Any], None]] = []
        self._view: dict[str, Any] = {"registry": None, "revision": -1, "entries": [], "ready": True, "versions": {}, "infos": ()}
        self._view_lock = threading.Lock()  # ``_take``'s compare-and-swap of ``_view``; readers read the reference without it
        self._refresh_task: Optional[asyncio.Task] = None
        # Since when, and with which kind of error, refreshes have been failing (None: the last one succeeded).
        self._refresh_outage: Optional[tuple[float, str]] = None
        self._clock = time.monotonic
        # Registry incarnations this ingress took views from and then moved on from (one per registry
        # restart), oldest first: the last ``LEFT_REGISTRIES_KEPT`` (a dict used as an ordered set).
        self._left_registries: dict[str, None] = {}
        # /metrics: the replicas' snapshots as last fetched, and the fetch a scrape stopped waiting
        # for (the next scrape waits for that one, so every reply is read and none piles up).
        self._snapshots_lock = threading.Lock()
        self._snapshots: dict[str, dict[str, Any]] = {}
        self._snapshot_fetch: Any = None
        self._snapshot_problem: Optional[str] = None  # why the last fetch failed (logged when it changes)
        # Replica id -> adapter names a scrape asked it to fold, sent by the next refresh (``_send_folds``).
        self._folds_lock = threading.Lock()
        self._folds: dict[str, set[str]] = {}
        self.shutting_down = False
        self.active = 0  # generate() calls not finished yet (requests in flight here)

    # ---- registry view ---------------------------------------------------------------------------
    def _take(self, view: dict[str, Any]) -> None:
        """Install the registry's ``view`` unless it is older than the one held, with what every
        request reads made once here: ``infos`` (``adapters()``, which resolves each request's
        model: 2000 AdapterInfo built per request took 2 ms of the one ingress's event loop) and
        ``versions`` (name -> version, ``_current_version``).

        A view whose ``entries`` is None says the set is the one of the (registry, revision) this
        ingress sent (``_known``): only its ``ready`` is taken, and only if that is still the
        (registry, revision) held (else it is dropped; the next refresh brings the entries).

        Revisions are compared within one registry actor (``registry``, its incarnation) only: a
        view older than the one held from the same registry is dropped (a refresh and an admin
        call's view can arrive in either order). A view from another registry, a restarted actor,
        is taken whatever its revision, and the registry left is not taken from again (a reply it
        sent before it died may arrive late; the last ``LEFT_REGISTRIES_KEPT`` registries left are
        refused so): a registry restarted from a lost or deleted
        manifest starts again below the revision held, and its set, hot updates included, must
        reach routing (the replicas follow it too: ``AdapterRegistryService.heartbeat``).

        The compare and the swap hold ``_view_lock``: the refresh (on the event loop) and an admin
        call (in a worker thread) both take views; without it, an "unchanged" reply for revision R
        compared against the R view held, then written over the R+1 view the admin call installed
        meanwhile, stepped routing back until the next refresh."""
        with self._view_lock:
            self._take_locked(view)

    def _take_locked(self, view: dict[str, Any]) -> None:
        held = self._view
        registry = view.get("registry")
        if registry != held.get("registry"):
            if registry in self._left_registries or view.get("entries") is None:
                return
            if held.get("registry") is not None:
                self._left_registries[held["registry"]] = None
                while len(self._left_registries) > self.LEFT_REGISTRIES_KEPT:
                    del self._left_registries[next(iter(self._left_registries))]
        elif view["revision"] < held["revision"]:
            return
        if view.get("entries") is None:
            if (view.get("registry"), view["revision"]) == (held.get("registry"), held["revision"]):
                self._view = {**held, "ready": view["ready"]}
            return
        infos = tuple(AdapterInfo(e["name"], e["version"], e["path"], e["max_rank"], e["registered_at"]) for e in view["entries"])
        self._view = {**view, "infos": infos, "versions": {i.name: i.version for i in infos}}  # one reference swap: readers see the old or the new view

    def _known(self) -> Optional[tuple[str, int]]:
        """The (registry, revision) of the view held, which a refresh sends (``AdapterRegistryService.view``)."""
        registry = self._view.get("registry")
        return None if registry is None else (registry, self._view["revision"])

    async def refresh(self) -> None:
        """Take the registry's view (without the entries when they did not change), then send the
        folds the last scrapes asked for."""
        self._take(await self.registry.view.remote(self._known()))
        await self._send_folds()

    def start_refresh(self) -> None:
        """Refresh every ``refresh_s`` until cancelled; a failed refresh is retried at the next tick
        (``_refresh_logged``)."""
        async def loop() -> None:
            while True:
                await asyncio.sleep(self.refresh_s)
                await self._refresh_logged()

        self._refresh_task = asyncio.create_task(loop())

    async def _refresh_logged(self) -> None:
        """``refresh``, with its failures logged once per outage, not at every tick: a line when
        refreshes start failing (a warning while the registry actor is away, an error for any other
        failure; again only if the kind of failure changes), and one when a refresh succeeds again,
        with how long they failed. Never raises: a stopped loop would freeze the adapter set here."""
        try:
            await self.refresh()
        except Exception as err:  # noqa: BLE001 - the loop must go on
            kind = type(err).__name__
            if self._refresh_outage is None or self._refresh_outage[1] != kind:
                if isinstance(err, ray.exceptions.RayActorError):
                    logger.warning("registry unavailable (%s); serving the last known adapter set until it is back", err)
                else:
                    logger.error("taking the registry's view failed (%s: %s); serving the last known adapter set, retrying", kind, err)
            since = self._refresh_outage[0] if self._refresh_outage is not None else self._clock()
            self._refresh_outage = (since, kind)
            return
        if self._refresh_outage is not None:
            logger.info("registry reachable again after %.1f s; the adapter set is current", self._clock() - self._refresh_outage[0])
            self._refresh_outage = None

    # ---- availability ------------------------------------------------------------------------------
    @property
    def dead_error(self) -> Optional[str]:
        """Why no request can be served yet (the application is starting), else None."""
        return None if self._view.get("ready", True) else STARTING

    @property
    def accepting(self) -> bool:
        """False while starting and once shutting down: new requests get a 503 ``engine_unavailable``."""
        return self.dead_error is None and not self.shutting_down

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on, and retry none on another replica."""
        self.shutting_down = True

    def adapters(self) -> list[AdapterInfo]:
        return list(self._view["infos"])

    def replica_snapshots(self) -> dict[str, dict[str, Any]]:
        """Live replica id -> its last engine snapshot (the report of its last heartbeat), fetched
        from the registry now: this blocks (up to ``SNAPSHOT_TIMEOUT_S``), so call it off the event
        loop (/metrics renders in a worker thread). Only a scrape fetches them: the refresh loop
        pulled every replica's whole snapshot twice a second, adapters x replicas entries with
        nothing changing.

        A replica the registry lists without a report yet (``AdapterRegistryService.replica_snapshots``:
        it restarted) keeps the snapshot fetched before, rather than showing none (which a scrape
        would read as its counters going back to 0). When the registry does not answer (within the
        timeout, or at all), the snapshots fetched last are returned; a fetch still running is
        waited for by the next call instead of starting another."""
        with self._snapshots_lock:
            try:
                if self._snapshot_fetch is None:
                    self._snapshot_fetch = self.registry.replica_snapshots.remote()
                fetched = ray.get(self._snapshot_fetch, timeout=self.SNAPSHOT_TIMEOUT_S)
            except GetTimeoutError:
                self._snapshot_failed(f"the registry did not answer within {self.SNAPSHOT_TIMEOUT_S:g} s")
                return dict(self._snapshots)
            except Exception as err:  # noqa: BLE001 - the scrape must still answer
                self._snapshot_fetch = None
                self._snapshot_failed(f"{type(err).__name__}: {err}")
                return dict(self._snapshots)
            self._snapshot_fetch, self._snapshot_problem = None, None
            held = self._snapshots
            self._snapshots = {rid: snap if snap is not None else held[rid] for rid, snap in fetched.items() if snap is not None or rid in held}
            return dict(self._snapshots)

    def _snapshot_failed(self, problem: str) -> None:
        if problem != self._snapshot_problem:  # log changes, not every scrape
            logger.warning("/metrics: could not fetch the replicas' snapshots from the registry (%s); showing the last ones fetched", problem)
        self._snapshot_problem = problem

    def fold_replica_adapter_counters(self, replica_id: str, names: Sequence[str]) -> None:
        """/metrics counts ``names`` of replica ``replica_id`` under ``__other__``: ask that replica
        (through the registry, at its next heartbeat) to fold the counters of those not registered
        into its engine's ``__other__`` entry (``LLMEngine.fold_adapter_counters``), so its books,
        and the reports it sends, do not keep every adapter it ever served. A scrape's worker
        thread calls it; the request goes with the next refresh (``_send_folds``), whose call is
        waited for, so a failure is logged here once, not left on an unread Ray reference."""
        unregistered = [name for name in names if name not in self._view["versions"]]
        if unregistered:
            with self._folds_lock:
                self._folds.setdefault(replica_id, set()).update(unregistered)

    async def _send_folds(self) -> None:
        """Send the folds asked for since the last send, in one call. One that fails is logged and
        dropped: the next scrape counts those names under ``__other__`` again, and asks again."""
        with self._folds_lock:
            folds, self._folds = self._folds, {}
        if not folds:
            return
        try:
            await self.registry.fold_adapter_counters.remote({rid: sorted(names) for rid, names in folds.items()})
        except Exception as err:  # noqa: BLE001 - the refresh must go on
            logger.warning("could not ask %d replica(s) to fold the counters of unloaded adapters (%s: %s); the next scrape asks again",
                           len(folds), type(err).__name__, err)  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        """Sum of the live replicas' snapshots (numbers add; per-adapter counters add by name)."""
        total: dict[str, Any] = {}
        for snap in self.replica_snapshots().values():
            _add_into(total, snap)
        return total

    # ---- admin -----------------------------------------------------------------------------------
    def register_adapter(self, name: str, path: str, *, within: Optional[Sequence[str]] = None) -> AdapterRef:
        """Validate on one replica (its read confined to ``within``: ``RegistryClient.validate``) and record."""
        try:
            return self.client.register(name, path, within=within)
        finally:  # also after a 503 (the change is recorded; some replica failed to apply it): requests carry its revision now
            self._take_view_after(f"load {name!r}")

    def unregister_adapter(self, name: str) -> None:
        try:
            self.client.unregister(name)
        finally:
            self._take_view_after(f"unload {name!r}")

    def _take_view_after(self, what: str) -> None:
        """Take the registry's view right after an admin call (``what``), whatever it answered, so
        requests carry the revision of a change it recorded. A failure here is logged, never
        raised: raised from the call's ``finally``, it replaced the call's own answer (a 400 for
        files that do not validate became a 500 once the registry was gone), or failed a change
        that was made. The refresh loop takes the view once the registry answers again."""
        try:
            self._take(ray.get(self.registry.view.remote(self._known())))
        except Exception as err:  # noqa: BLE001 - the admin call's own answer stands
            logger.warning("%s: could not take the registry's view after the call (%s: %s); requests carry the revision this ingress "
                           "held until a refresh succeeds", what, type(err).__name__, err)  # fmt: skip

    def add_observer(self, callback: Callable[[Any], None]) -> None:
        self._observers.append(callback)

    # ---- requests ----------------------------------------------------------------------------------
    @staticmethod
    def admission_group(size: int) -> "VersionGroup":
        """A group for the ``size`` engine requests of one HTTP request (see ``VersionGroup``)."""
        return VersionGroup(size)

    def _current_version(self, adapter: str) -> Optional[str]:
        return self._view["versions"].get(adapter)

    def _stream(self, request_id: str, prompt: Any, params: SamplingParams, adapter: Optional[str], pinned_version: Optional[str]) -> Any:
        options: dict[str, Any] = {"stream": True}
        if self.routing == "affinity" and adapter is not None:
            options["multiplexed_model_id"] = adapter
        # The registry revision this ingress knows (and of which registry actor), and the version it names for the adapter:
        # a replica behind that revision syncs before serving, and one that cannot serves the adapter only in that version
        # (LoraReplica.generate).
        view = self._view
        expected = view["versions"].get(adapter) if adapter is not None else None
        return self.replicas.options(**options).generate.remote(request_id, prompt, params, adapter, pinned_version, view["revision"], expected,
                                                                view.get("registry"))

    async def generate(
        self, request_id: str, prompt: str | Sequence[int], params: Optional[SamplingParams] = None, adapter: Optional[str] = None,
        group: Optional["VersionGroup"] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request from a replica. ``group``: pin it, with the group's other requests, to
        one adapter version (``VersionGroup``). The replica's outputs are read as they arrive and
        merged while the caller lags (``read_ahead``): a caller that falls behind does not leave
        one Ray object per step waiting at the ingress."""
        if not self.accepting:
            raise EngineDeadError(self.dead_error or SHUTTING_DOWN)
        self.active += 1
        stream = read_ahead(self._generate(request_id, prompt, params, adapter, group))
        try:
            async for delta in stream:
                yield delta
        finally:
            self.active -= 1
            await stream.aclose()  # now, not when collected: it aborts the replica's request if the client went away

    async def _generate(
        self, request_id: str, prompt: str | Sequence[int], params: Optional[SamplingParams], adapter: Optional[str], group: Optional["VersionGroup"],
    ) -> AsyncIterator[RequestOutput]:
        params = params or SamplingParams()
        emitted_ids: tuple[int, ...] = ()
        emitted_text = ""
        # The adapter version the tokens passed on came from; for a group's request, the group's version from the start.
        pinned: Optional[str] = group.pin(adapter, self._current_version) if group is not None and adapter is not None else None
        prompt_ids: Sequence[int] = ()  # known once an output arrived
        logprobs: list[TokenLogprobs] = []  # rebuilt from the wire's new-token entries (replica.on_the_wire)
        prompt_logprobs: Optional[tuple[Optional[TokenLogprobs], ...]] = None
        counted = False  # a replica's record of this request reached the observers

        def count_failure() -> None:
            """The request fails after a replica took it (the replica died, or its replay failed):
            the replica's record never comes back, so count it here, as an error, unless one came."""
            if not counted:
                metrics = abandoned_request_metrics(request_id, adapter, pinned, prompt_ids, emitted_ids, finish_reason="error")
                for observer in self._observers:
                    observer(metrics)

        attempt = 0
        while True:
            stream = self._stream(request_id if attempt == 0 else f"{request_id}-retry{attempt}", prompt, params, adapter, pinned)
            finished = False
            received: Optional[RequestOutput] = None  # this stream's last output, put back together (replica.off_the_wire)
            try:
                async for item in stream:
                    if item[0] == "error":
                        if emitted_ids:  # a replay after output was passed on: the client retries the whole request
                            raise ReplicaUnavailable(request_id, f"the replay on another replica was refused: {item[2]}")
                        raise replica_error(item[1], item[2])
                    wire, metrics = item[1], item[2]
                    start = len(received.token_ids) if received is not None else 0  # tokens of this stream before this output
                    out = received = off_the_wire(wire, received)
                    if metrics is not None:
                        counted = True
                        for observer in self._observers:
                            observer(metrics)
                    if wire.logprobs is not None:  # this output's new tokens only; a replay repeats positions already held
                        logprobs.extend(wire.logprobs[len(logprobs) - start :] if start <= len(logprobs) else ())
                    if out.prompt_logprobs is not None and prompt_logprobs is None:
                        prompt_logprobs = out.prompt_logprobs
                    if len(out.token_ids) < len(emitted_ids) or (len(out.token_ids) == len(emitted_ids) and not out.finished):
                        continue  # replaying what was already passed on
                    if emitted_ids and _version(out) != pinned:
                        raise ReplicaUnavailable(request_id, f"the replay on another replica ran on adapter version {_version(out)}, not {pinned}")
                    # (The first stream's outputs extend each other by construction: off_the_wire.)
                    if attempt > 0 and (out.token_ids[: len(emitted_ids)] != emitted_ids or not out.text.startswith(emitted_text)):
                        raise ReplicaUnavailable(request_id, "the replay on another replica diverged from the tokens already sent")
                    delta = dataclasses.replace(
                        out, request_id=request_id, new_token_ids=out.token_ids[len(emitted_ids):], new_text=out.text[len(emitted_text):],
                        logprobs=PrefixView(logprobs, len(out.token_ids)) if params.logprobs is not None else None,
                        prompt_logprobs=prompt_logprobs if params.prompt_logprobs is not None else None,
                    )
                    emitted_ids, emitted_text, pinned, prompt_ids = out.token_ids, out.text, _version(out), out.prompt_token_ids
                    finished = out.finished
                    yield delta
                return
            except ReplicaUnavailable:  # the replay was refused, ran on another version, or diverged
                count_failure()
                raise
            except (GeneratorExit, asyncio.CancelledError):
                if not finished:  # the client went away: the replica aborts, but its record of that never comes back here
                    metrics = abandoned_request_metrics(request_id, adapter, pinned, prompt_ids, emitted_ids)
                    for observer in self._observers:
                        observer(metrics)
                raise
            except ray.exceptions.RayActorError as err:
                if finished:  # the final output was passed on before the stream's end got lost: nothing to retry
                    return
                if self.shutting_down:  # the replicas are going away; another one would not serve it either
                    count_failure()
                    raise APIError(503, f"request {request_id}: the server is shutting down, and the replica serving the request stopped "
                                        f"before it finished ({type(err).__name__})", code="engine_unavailable") from err
                replayable = not emitted_ids or params.greedy
                if attempt >= 1 or not replayable:
                    count_failure()
                    raise ReplicaUnavailable(request_id, type(err).__name__) from err
                logger.warning("request %s: replica died (%s); retrying once on another replica", request_id, type(err).__name__)
                attempt += 1
            finally:
                if not finished:
                    stream.cancel()  # propagates to the replica, whose engine aborts the request


class VersionGroup:
    """The engine requests of one HTTP request (its prompts and ``n`` choices) at a Ray ingress.
    Replicas admit them separately, so they cannot be admitted in one lock hold as in one
    process; instead each is pinned to the adapter version its group saw first in this
    ingress's registry view. A replica holding another version refuses it (503
    ``adapter_unavailable``, to retry), so the request never mixes versions."""

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"VersionGroup: size must be an integer >= 1, got {size!r}")
        self.size = size
        self.members = 0
        self.versions: dict[str, Optional[str]] = {}

    def pin(self, adapter: str, current_version: Callable[[str], Optional[str]]) -> Optional[str]:
        """The version this group's requests for ``adapter`` run on (None: not registered here;
        the replica then answers that)."""
        if self.members >= self.size:
            raise ValueError(f"VersionGroup: more than its {self.size} requests")
        self.members += 1
        if adapter not in self.versions:
            self.versions[adapter] = current_version(adapter)
        return self.versions[adapter]


class PrefixView(SequenceABC):
    """The first ``length`` items of an append-only list, read-only: what each streamed output's
    ``logprobs`` is at the ingress. A tuple copy per output would cost the event loop O(n) per
    token, O(n^2) per request (2.4 s for 32k tokens); the list only ever grows, so earlier
    views stay valid. Equal to any sequence with the same items (a tuple, another view)."""

    def __init__(self, items: list[TokenLogprobs], length: int) -> None:
        self._items, self._length = items, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self._items[i] for i in range(*index.indices(self._length)))
        if not -self._length <= index < self._length:
            raise IndexError("PrefixView index out of range")
        return self._items[index % self._length]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SequenceABC) and not isinstance(other, str) and len(other) == self._length and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"PrefixView({tuple(self)!r})"


def abandoned_request_metrics(
    request_id: str, adapter: Optional[str], version: Optional[str], prompt_ids: Sequence[int], output_ids: Sequence[int],
    finish_reason: str = "abort",
) -> RequestMetrics:
    """What the ingress knows of a request whose client went away: its adapter and the tokens
    it received (prompt tokens only once an output showed the prompt ran; ``read_ahead`` takes
    tokens off the wire before the client reads them, as the replica's engine counts the tokens it
    generated, read or not), no timings. The
    replica's engine records the abort in full, but its stream is cancelled before that record
    could travel back, so /metrics counts the abort from this. ``finish_reason`` "error": one
    that failed because its replica died (or its replay failed), whose record is lost too."""
    return RequestMetrics(request_id=request_id, adapter=adapter, adapter_version=version, queue_time=None, ttft=None, tpot=None,
                          prompt_tokens=len(prompt_ids), output_tokens=len(output_ids), preemptions=0, adapter_location="unknown",
                          finish_reason=finish_reason)


def _version(out: RequestOutput) -> Optional[str]:
    return out.adapter.version if out.adapter is not None else None


def _add_into(total: dict[str, Any], snap: dict[str, Any]) -> None:
    for key, value in snap.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            total[key] = total.get(key, 0) + value
        elif isinstance(value, dict):
            _add_into(total.setdefault(key, {}), value)
