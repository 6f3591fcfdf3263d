"""Per-request metrics and per-adapter counters, for observers and the metrics endpoint.

    queue_time = first scheduled - arrival
    ttft       = first token - arrival
    tpot       = (last token - first token) / (output_tokens - 1)  (None with one token; the
                 last token, not the finish: an abort or a client that leaves later adds no idle time)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runtime.request import Sequence

# The base model's label in per-adapter metrics; no adapter may take this name.
BASE_LABEL = "__base__"
# The one label the adapters past the metrics' adapter-label cap share (ServerMetrics); reserved too.
OTHER_LABEL = "__other__"


@dataclass(frozen=True)
class RequestMetrics:
    request_id: str
    adapter: Optional[str]  # adapter name, None for the base model
    adapter_version: Optional[str]
    queue_time: Optional[float]  # None: never scheduled (aborted or failed while waiting)
    ttft: Optional[float]
    tpot: Optional[float]
    prompt_tokens: int
    output_tokens: int
    preemptions: int
    adapter_location: str  # where the adapter was at arrival: "device" | "host" | "disk" | "none"; "unknown" (Ray ingress, abandoned request)
    finish_reason: Optional[str]
    adapter_wait: Optional[float] = None  # arrival -> adapter on host/device (0 if it was); None: no adapter, or never loaded

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        queue = seq.first_scheduled_time - seq.arrival_time if seq.first_scheduled_time is not None else None
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time is not None else None
        n_out = len(seq.output_token_ids)
        tpot = None
        if seq.first_token_time is not None and seq.last_token_time is not None and n_out > 1:  # one token: no gap
            tpot = (seq.last_token_time - seq.first_token_time) / (n_out - 1)
        return cls(
            request_id=seq.request_id,
            adapter=seq.adapter.name if seq.adapter is not None else None,
            adapter_version=seq.adapter.version if seq.adapter is not None else None,
            queue_time=queue,
            ttft=ttft,
            tpot=tpot,
            prompt_tokens=len(seq.prompt_token_ids),
            output_tokens=n_out,
            preemptions=seq.preemptions,
            adapter_location=seq.adapter_location,
            finish_reason=seq.finish_reason,
            adapter_wait=seq.adapter_ready_time - seq.arrival_time if seq.adapter_ready_time is not None else None,
        )


@dataclass
class AdapterRequestCounters:
    """Per adapter name (or "" for the base model): finished requests and their tokens."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    errors: int = 0
    preemptions: int = 0

    def record(self, m: RequestMetrics) -> None:
        self.requests += 1
        self.prompt_tokens += m.prompt_tokens
        self.output_tokens += m.output_tokens
        self.preemptions += m.preemptions
        if m.finish_reason == "error":
            self.errors += 1
