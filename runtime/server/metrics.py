"""Prometheus metrics with per-adapter labels, on a registry owned by one app.

Per-request figures (TTFT, TPOT, queue time, tokens) come from the engine's
finished-request observer; pool, KV and cache counters are read from the engine's
snapshot at scrape time, so they can never drift from the engine's own books.

Label cap (``AdapterLabels``): each adapter costs ~80 lines (four histograms of 17 lines,
counters), and prometheus_client renders ~8 us a line while holding the GIL, so 1000 busy
adapters made every scrape 0.6-1.2 s that the step thread and event loop waited through (a
soak measured streams' inter-token gaps going from 17 to 215 ms at p99). The first
``max_adapters`` adapters to get a request keep series of their own; every later one is
counted under ``adapter="__other__"``. An adapter's pool counters show only once it has had a
request, or once the cap is full (under ``__other__``), so a server with thousands of adapters
registered and few used stays small too. The set never changes once full, so no series goes
back: ``__other__`` only grows. (The set lives in this process: under Ray it is the ingress's,
and an ingress restart chooses it again, which can move counts between series.)

Bounded books (``fold_counters``, a single engine): after each scrape the engine is handed the
names just counted under ``__other__``; it folds those no longer registered into its own
``__other__`` entry, which is rendered under that label too, so the page does not change and the
engine's per-name tables do not grow with every adapter ever unloaded. Under Ray (per-replica
snapshots) the names are handed, per replica, to ``fold_replica_counters``: the ingress relays them
through the registry to that replica, whose engine folds them the same way at its next heartbeat.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from runtime.stats import BASE_LABEL, OTHER_LABEL  # the base model's adapter label, the capped adapters' one

# Snapshot counters that only requests move (registration alone counts a load): an adapter with
# any of them has had a request, and claims its label at scrape time like a finished one does.
REQUEST_KEYS = ("device_hits", "host_hits", "disk_misses")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class AdapterLabels:
    """Which adapters get a label of their own: the first ``max_adapters`` seen with a request (a
    finished one, or at a scrape one the pool counted on arrival)."""

    def __init__(self, max_adapters: int) -> None:
        if max_adapters < 0:
            raise ValueError(f"max_adapters must be >= 0, got {max_adapters}")
        self.max_adapters = max_adapters
        self._own: set[str] = set()
        self._lock = threading.Lock()  # the engine's observer thread and a scrape's worker thread both claim

    @property
    def full(self) -> bool:
        return len(self._own) >= self.max_adapters

    def requested(self, adapter: str | None) -> str:
        """The label for a request of ``adapter`` (None: the base model); claims one if any is left."""
        if adapter is None:
            return BASE_LABEL
        with self._lock:
            if adapter not in self._own and not self.full:
                self._own.add(adapter)
            return adapter if adapter in self._own else OTHER_LABEL

    def for_counters(self, adapter: str, had_requests: bool) -> str | None:
        """The label for an adapter's pool counters at scrape time: once it has had a request, its
        own if it holds or can claim one, else ``__other__``. Before that, none (not shown) while
        the cap is not full: it may still claim a label, and moving its counts out of ``__other__``
        would make that series go back; once the cap is full it is counted under ``__other__``."""
        if had_requests:
            return self.requested(adapter)
        with self._lock:
            if adapter in self._own:
                return adapter
            return OTHER_LABEL if self.full else None


class ServerMetrics:
    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        replica: str | None = None,
        replica_snapshots: Callable[[], dict[str, dict[str, Any]]] | None = None,
        max_adapters: int = 100,
        fold_counters: Callable[[list[str]], None] | None = None,
        fold_replica_counters: Callable[[str, list[str]], None] | None = None,
    ) -> None:
        """``fold_counters(names)``: a single engine's fold (module docstring); with
        ``replica_snapshots``, ``fold_replica_counters(replica, names)`` is called instead, per replica."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = AdapterLabels(max_adapters)
        labels = ["adapter"]
        self.requests = Counter("lorafleet_requests", "Finished requests", labels + ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("lorafleet_prompt_tokens", "Prompt tokens of finished requests that reached the model (scheduled at least once)", labels, registry=self.registry)
        self.output_tokens = Counter("lorafleet_generation_tokens", "Tokens generated", labels, registry=self.registry)
        self.ttft = Histogram("lorafleet_time_to_first_token_seconds", "Time to first token", labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("lorafleet_time_per_output_token_seconds", "Time per output token after the first", labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.adapter_wait = Histogram("lorafleet_adapter_wait_seconds", "From arrival until the request's adapter was on the host or device (0 when it already was)",
                                      labels, buckets=LATENCY_BUCKETS, registry=self.registry)  # fmt: skip
        self.queue = Histogram("lorafleet_queue_time_seconds", "Time from arrival to first scheduling", labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        def rows() -> list[tuple[str | None, dict[str, Any]]]:
            if replica_snapshots is not None:
                return sorted(replica_snapshots().items())  # one series per replica
            return [(replica, snapshot())]

        fold: Callable[[str | None, list[str]], None] | None = None
        if replica_snapshots is not None:
            fold = fold_replica_counters
        elif fold_counters is not None:
            fold = lambda _replica, names: fold_counters(names)  # noqa: E731 - one engine's books
        self.registry.register(_SnapshotCollector(rows, labelled=replica is not None or replica_snapshots is not None, adapter_labels=self.labels, fold=fold))

    def observe(self, m: Any) -> None:
        """Engine observer: called once per finished request with its RequestMetrics."""
        adapter = self.labels.requested(m.adapter)
        self.requests.labels(adapter, m.finish_reason or "unknown").inc()
        if m.queue_time is not None or m.output_tokens > 0:  # aborted or failed while waiting: its prompt never ran
            self.prompt_tokens.labels(adapter).inc(m.prompt_tokens)
        self.output_tokens.labels(adapter).inc(m.output_tokens)
        if m.ttft is not None:
            self.ttft.labels(adapter).observe(m.ttft)
        if m.tpot is not None:
            self.tpot.labels(adapter).observe(m.tpot)
        if m.queue_time is not None:
            self.queue.labels(adapter).observe(m.queue_time)
        if m.adapter_wait is not None:
            self.adapter_wait.labels(adapter).observe(m.adapter_wait)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    """Gauges and counters read from engine snapshots at scrape time.

    ``rows()`` gives (replica label, snapshot) pairs: one pair for a single engine, one per
    replica for an application spread over replicas (then every series has ``replica``).
    """

    def __init__(self, rows: Callable[[], list[tuple[str | None, dict[str, Any]]]], labelled: bool, adapter_labels: AdapterLabels,
                 fold: Callable[[str | None, list[str]], None] | None = None) -> None:
        self.rows = rows
        self.labelled = labelled
        self.adapter_labels = adapter_labels
        self.fold = fold

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        rows = self.rows()
        extra = ["replica"] if self.labelled else []
        gauges = {
            "running": GaugeMetricFamily("lorafleet_requests_running", "Sequences running", labels=extra),
            "waiting": GaugeMetricFamily("lorafleet_requests_waiting", "Sequences waiting", labels=extra),
            "kv_blocks_total": GaugeMetricFamily("lorafleet_kv_blocks", "KV blocks in the pool (free or not)", labels=extra),
            "kv_blocks_free": GaugeMetricFamily("lorafleet_kv_blocks_free", "KV blocks free", labels=extra),
            "pool_device_bytes_in_use": GaugeMetricFamily("lorafleet_adapter_pool_bytes_in_use", "Device adapter pool bytes in use", labels=extra),
            "pool_device_bytes_capacity": GaugeMetricFamily("lorafleet_adapter_pool_bytes_capacity", "Device adapter pool capacity in bytes", labels=extra),
            "host_entries": GaugeMetricFamily("lorafleet_adapter_host_entries", "Adapters in the host tier", labels=extra),
            "host_bytes_in_use": GaugeMetricFamily("lorafleet_adapter_host_bytes_in_use", "Bytes of adapter weights in the host tier", labels=extra),
            "host_bytes_capacity": GaugeMetricFamily("lorafleet_adapter_host_bytes_capacity", "The host tier's bound in bytes "
                                                     "(--max-cpu-lora-bytes; +Inf when only --max-cpu-loras bounds it)", labels=extra),
            "kv_block_refcount_total": GaugeMetricFamily("lorafleet_kv_block_refcount", "References held on KV blocks (summed)", labels=extra),
        }
        totals = {
            "preemptions": CounterMetricFamily("lorafleet_preemptions", "Running sequences preempted because the KV cache ran out: their "
                                               "KV is freed and recomputed when they are admitted again (KV pressure)", labels=extra),
            "prefix_cache_queried_blocks": CounterMetricFamily("lorafleet_prefix_cache_queried_blocks", "Full prompt blocks looked up in the "
                                                               "prefix cache, once per request at its first admission (0 with prefix caching off)",
                                                               labels=extra),
            "prefix_cache_hit_blocks": CounterMetricFamily("lorafleet_prefix_cache_hit_blocks", "Of those, the blocks reused from the prefix "
                                                           "cache (hit rate: hit over queried; a readmission after a preemption is not counted)",
                                                           labels=extra),
        }
        # Leak checks read these: like running, waiting and kv_block_refcount, 0 on an idle server.
        refcounts = {
            "adapter_demand": GaugeMetricFamily("lorafleet_adapter_demand", "Live requests bound to an adapter version (summed)", labels=extra),
            "adapter_device_refs": GaugeMetricFamily("lorafleet_adapter_device_refs", "Running sequences pinning an adapter device slot (summed)", labels=extra),
        }
        families = {
            "loads": CounterMetricFamily("lorafleet_adapter_loads", "Adapter loads from disk into the host tier", labels=["adapter"] + extra),
            "device_loads": CounterMetricFamily("lorafleet_adapter_device_loads", "Adapter copies from host to device", labels=["adapter"] + extra),
            "host_evictions": CounterMetricFamily("lorafleet_adapter_host_evictions", "Adapter evictions from the host tier to make room",
                                                  labels=["adapter"] + extra),
            "device_evictions": CounterMetricFamily("lorafleet_adapter_device_evictions", "Adapter evictions from device slots to make room",
                                                    labels=["adapter"] + extra),
            "retired": CounterMetricFamily("lorafleet_adapter_versions_retired", "Adapter versions dropped from the pool after a hot "
                                           "update or unregister, once no request needed them (not counted as evictions)",
                                           labels=["adapter"] + extra),
            "device_hits": CounterMetricFamily("lorafleet_adapter_device_hits", "Requests whose adapter was already on device", labels=["adapter"] + extra),
            "host_hits": CounterMetricFamily("lorafleet_adapter_host_hits", "Requests whose adapter was in the host tier", labels=["adapter"] + extra),
            "disk_misses": CounterMetricFamily("lorafleet_adapter_disk_misses", "Requests whose adapter had to be read from disk", labels=["adapter"] + extra),
        }
        for replica, snap in rows:
            extra_values = [replica or ""] if self.labelled else []
            for key, gauge in gauges.items():
                value = snap.get(key, 0)
                gauge.add_metric(extra_values, math.inf if value is None else float(value))  # None: no bound (host_bytes_capacity)
            for key, total in totals.items():
                total.add_metric(extra_values, float(snap.get(key, 0)))
            for key, gauge in refcounts.items():
                gauge.add_metric(extra_values, float(snap.get("total_refcounts", {}).get(key, 0)))
            summed: dict[str, dict[str, float]] = {}  # label -> family key -> value (adapters past the cap add up)
            foldable: list[str] = []  # counted under __other__ from now on (the label set is full and fixed)
            for name, counters in sorted(snap.get("adapters", {}).items()):
                if not name:  # the base model's request counters: it has no adapter pool series
                    continue
                if name == OTHER_LABEL:  # the engine's entry of folded adapters (``fold_counters``)
                    label: str | None = OTHER_LABEL
                else:
                    label = self.adapter_labels.for_counters(name, any(counters.get(k, 0) for k in REQUEST_KEYS))
                    if label == OTHER_LABEL:
                        foldable.append(name)
                if label is None:
                    continue
                values = summed.setdefault(label, dict.fromkeys(families, 0.0))
                for key in families:
                    values[key] += float(counters.get(key, 0))
            for label, values in summed.items():
                for key, family in families.items():
                    family.add_metric([label] + extra_values, values[key])
            if self.fold is not None and foldable:
                self.fold(replica, foldable)
        yield from gauges.values()
        yield from totals.values()
        yield from refcounts.values()
        yield from families.values()
