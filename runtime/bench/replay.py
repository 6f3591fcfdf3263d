"""Replay a workload against lorafleet: in-process (AsyncLLMEngine) or over HTTP (streaming).

Each request is sent at its arrival time (``arrival_s`` after the start) with
``ignore_eos`` and ``max_tokens = output_tokens``, greedy. Client-side timings:

    ttft    = first streamed token - arrival
    tpot    = (last token - first token) / (output tokens - 1)
    latency = last token - arrival

In-process, ``engine_ttft`` is the engine's own TTFT for the request (``RequestMetrics.ttft``
from its observer: its first token - its arrival). The engine stamps its arrival in
``add_request`` (after the client's arrival time; queueing inside the engine counts in both) and
its first token in the step that sampled it, before the client reads it, so
``engine_ttft <= ttft``; the difference is submission and streaming overhead. Requests that
share an arrival time (an offline burst) are admitted as one group, in one hold of the engine's
lock, so none of them reaches the engine steps after the others (with the adapter locations,
which the engine samples at admission, changed meanwhile) and a burst replays the same way
every time; the engine refuses such a group whole, so one unservable request fails its burst.

Over HTTP, token times come from the chunks whose running ``usage.completion_tokens`` grew
(``stream_options.continuous_usage_stats``, which lorafleet and vLLM send). A server that
reports usage only at the end (or never) gets its token times from the chunks that carry text
instead (``timing: "text"`` in the record, and a warning): a chunk may then hold several tokens,
and a stream whose text came in one chunk has no TPOT (None), as one whose
tokens all came in one chunk that carried their count. One untimed base-model request
warms the server up first.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from runtime.request import SamplingParams
from runtime.stats import RequestMetrics

log = logging.getLogger("lorafleet.bench")


@dataclass
class RequestRecord:
    index: int
    adapter: Optional[str]
    arrival_s: float
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: Optional[float] = None
    tpot: Optional[float] = None
    latency: Optional[float] = None
    adapter_location: Optional[str] = None  # where the adapter was on arrival (in-process only)
    error: Optional[str] = None
    engine_ttft: Optional[float] = None  # the engine's own TTFT (in-process only; None: not measured)
    timing: str = "tokens"  # "text": over HTTP without running usage, token times are those of text chunks


@dataclass
class ReplayResult:
    label: str
    records: list[RequestRecord]
    wall_s: float
    snapshot: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    peak_rss_bytes: Optional[int] = None  # this process's peak RSS after an in-process run; None where not measured (HTTP, PEFT)


def sampling_params(output_tokens: int) -> SamplingParams:
    """A workload request's sampling: greedy, exactly ``output_tokens`` tokens (EOS ignored)."""
    return SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)


async def _paced(requests: Sequence[Any], start: float, run_one: Callable[[Any, float], Any], progress: Optional[Callable[[], None]]) -> list[RequestRecord]:
    async def one(req: Any) -> RequestRecord:
        delay = start + req.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record = await run_one(req, start + req.arrival_s)
        if progress is not None:
            progress()
        return record

    return list(await asyncio.gather(*(one(r) for r in requests)))


def _finish(record: RequestRecord, arrival: float, first: Optional[float], last: float, n_out: int, spread: bool = True) -> RequestRecord:
    """Times from the first and last token's arrival; ``spread`` False: all ``n_out`` tokens came at
    one moment (one text chunk), so there is no inter-token time to measure (``tpot`` None)."""
    record.output_tokens = n_out
    if first is not None:
        record.ttft = first - arrival
        record.tpot = (last - first) / (n_out - 1) if n_out > 1 and spread else None  # one token: no inter-token time
        record.latency = last - arrival
    return record


async def replay_engine(engine: Any, requests: Sequence[Any], label: str, adapter_of: Callable[[Any], Optional[str]] = lambda r: r.adapter,
                        progress: Optional[Callable[[], None]] = None, metrics: Optional[dict[str, RequestMetrics]] = None) -> ReplayResult:
    """Drive an AsyncLLMEngine in this process; adapter locations and the engine's own TTFT
    come from the RequestMetrics its observer reports.

    Pass a shared ``metrics`` dict (request id -> RequestMetrics, already fed by an observer)
    when replaying many times on one engine, so observers do not pile up.
    """
    if metrics is None:
        metrics = {}
        engine.add_observer(lambda m: metrics.__setitem__(m.request_id, m))
    from runtime.async_engine import admits_groups

    groups: dict[float, Any] = {}
    if admits_groups(engine):
        bursts = Counter(r.arrival_s for r in requests)
        groups = {at: engine.admission_group(n) for at, n in bursts.items() if n > 1}

    async def run_one(req: Any, arrival: float) -> RequestRecord:
        rec = RequestRecord(req.index, adapter_of(req), req.arrival_s)
        first, last, final = None, arrival, None
        burst = groups.get(req.arrival_s)
        try:
            stream = engine.generate(f"{label}-{req.index}", req.prompt, sampling_params(req.output_tokens), rec.adapter,
                                     **({"group": burst} if burst is not None else {}))
            async for out in stream:
                now = time.perf_counter()
                if out.new_token_ids and first is None:
                    first = now
                last, final = now, out
        except Exception as err:  # noqa: BLE001 - recorded per request, the run goes on
            rec.error = f"{type(err).__name__}: {err}"
            return rec
        if final is not None and final.finish_reason == "error":
            rec.error = final.error
        rec.prompt_tokens = len(final.prompt_token_ids) if final is not None else 0
        return _finish(rec, arrival, first, last, len(final.token_ids) if final is not None else 0)

    start = time.perf_counter()
    records = await _paced(requests, start, run_one, progress)
    wall = time.perf_counter() - start
    for rec in records:
        m = metrics.get(f"{label}-{rec.index}")
        if m is not None:
            rec.adapter_location, rec.engine_ttft = m.adapter_location, m.ttft
    return ReplayResult(label, records, wall, snapshot=engine.snapshot())


def _error_text(body: str, limit: int = 300) -> str:
    """An error reply's message: OpenAI's ``{"error": {"message": ..., "code": ...}}`` as "message (code)"
    (or FastAPI's ``{"detail": ...}``) when the body is that, else the body's text; at most ``limit``
    characters, an ellipsis where cut."""
    try:
        raw = json.loads(body)
        error = raw.get("error")
        text = error["message"] if isinstance(error, dict) else raw["detail"]
        text = text if isinstance(text, str) else json.dumps(text)
        if isinstance(error, dict) and isinstance(error.get("code"), str) and error["code"]:
            text = f"{text} ({error['code']})"
    except (ValueError, KeyError, TypeError, AttributeError):
        text = " ".join(body.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def served_models(base_url: str, api_key: Optional[str] = None) -> list[dict[str, Any]]:
    """The model cards a running server lists (GET /v1/models ``data``), in its order.

    A reply other than 200 is an ``httpx.HTTPStatusError`` whose one-line message gives the
    status and the start of the body (a wrong or missing key: 401; not a lorafleet server: 404);
    a 200 that is not a model list with at least one card carrying a string ``id`` is a
    ``ValueError``. ``base_url`` may end with a slash."""
    import httpx

    url = f"{base_url.rstrip('/')}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(url, headers=headers, timeout=30)
    try:
        resp.raise_for_status()
    except httpx.HTTPStatusError as err:
        body = " ".join(resp.text.split())[:200]
        raise httpx.HTTPStatusError(f"GET {url}: HTTP {resp.status_code} {resp.reason_phrase}" + (f": {body}" if body else ""),
                                    request=err.request, response=err.response) from None  # fmt: skip
    try:
        cards = resp.json()["data"]
        if not isinstance(cards, list) or not cards or not all(isinstance(c, dict) and isinstance(c["id"], str) for c in cards):
            raise ValueError
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"GET {url}: not an OpenAI model list with at least one model: {' '.join(resp.text.split())[:200]!r}") from None
    return cards


def prompt_token_counts(base_url: str, model: str, prompts: Sequence[str], api_key: Optional[str] = None) -> Optional[dict[str, int]]:
    """prompt -> its token count as the server's completions route encodes it, from its
    ``POST /tokenize`` (vLLM's route; lorafleet serves it too), one call per distinct prompt.
    None when the server has no such route or answers anything but a count (an OpenAI-style
    server): the caller falls back to a bound."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    counts: dict[str, int] = {}
    with httpx.Client(timeout=30, headers=headers) as client:
        for prompt in dict.fromkeys(prompts):
            resp = client.post(f"{base_url.rstrip('/')}/tokenize", json={"model": model, "prompt": prompt})
            try:
                count = resp.json()["count"] if resp.status_code == 200 else None
            except (ValueError, KeyError, TypeError):
                count = None
            if type(count) is not int or count < 0:
                return None
            counts[prompt] = count
    return counts


def base_model_of(cards: Sequence[dict[str, Any]]) -> str:
    """The base model among ``served_models``' cards: the first whose ``parent`` is null (lorafleet
    and vLLM list adapters with ``parent: <base>``); the first card when none says."""
    return str(next((c["id"] for c in cards if "parent" in c and c["parent"] is None), cards[0]["id"]))


def served_base_model(base_url: str, api_key: Optional[str] = None) -> str:
    """The base model's name as a running server lists it (``base_model_of(served_models(...))``);
    raises as ``served_models``."""
    return base_model_of(served_models(base_url, api_key))


async def replay_http(base_url: str, base_model: str, requests: Sequence[Any], label: str, api_key: Optional[str] = None,
                      progress: Optional[Callable[[], None]] = None, timeout_s: float = 600.0, transport: Any = None) -> ReplayResult:
    """Stream every request from a running ``lorafleet serve`` (/v1/completions, SSE).

    ``transport``: an httpx transport to use instead of the network (tests pass an ASGI one).
    The result has no engine snapshot: pool counters are not measured over HTTP."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(1, len(requests)))
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, limits=limits, transport=transport) as client:

        async def run_one(req: Any, arrival: float) -> RequestRecord:
            rec = RequestRecord(req.index, req.adapter, req.arrival_s)
            # continuous_usage_stats: a chunk with the running token count for every step that made tokens,
            # so TTFT and TPOT time tokens, not text (a token may decode to no text yet).
            body = {"model": req.adapter or base_model, "prompt": req.prompt, "max_tokens": req.output_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            first, last, n_out, counted = None, arrival, 0, 0
            counted_with_text = False  # a chunk that raised the count carried text too (running usage, not usage at the end)
            text_times: list[float] = []
            try:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        rec.error = f"HTTP {resp.status_code}: {_error_text((await resp.aread()).decode(errors='replace'))}"
                        return rec
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            rec.error = chunk["error"]["message"]
                            return rec
                        now = time.perf_counter()
                        has_text = any(c.get("text") for c in chunk.get("choices") or ())
                        if has_text:
                            text_times.append(now)
                        usage = chunk.get("usage")
                        if usage:
                            rec.prompt_tokens = usage["prompt_tokens"]
                            if usage["completion_tokens"] > n_out:  # this chunk brought new tokens
                                first = now if first is None else first
                                last, n_out, counted = now, usage["completion_tokens"], counted + 1
                                counted_with_text = counted_with_text or has_text
            except httpx.HTTPError as err:
                rec.error = f"{type(err).__name__}: {err}"
                return rec
            # Usage at the end only (or none): time the text chunks. One chunk holding both the text and
            # a count of 1 is a one-token answer under running usage: timed by its count.
            if text_times and counted <= 1 and (counted == 0 or not counted_with_text or len(text_times) > 1):
                rec.timing = "text"
                first, last, n_out = text_times[0], text_times[-1], max(n_out, len(text_times))
            if n_out == 0:
                rec.error = "the stream carried no tokens (no usage counts and no text)"
                return rec
            # Every token in one chunk (one text chunk, or one chunk that raised the count to n_out): no inter-token time.
            return _finish(rec, arrival, first, last, n_out, spread=len(text_times) > 1 if rec.timing == "text" else counted > 1)

        try:  # untimed: the first request of a fresh server pays one-off costs
            await client.post("/v1/completions", json={"model": base_model, "prompt": "warm up", "max_tokens": 2})
        except httpx.HTTPError as err:
            log.warning("warm-up request failed (%s); timing anyway", err)
        start = time.perf_counter()
        records = await _paced(requests, start, run_one, progress)
        wall = time.perf_counter() - start
    by_text = sum(r.timing == "text" for r in records)
    if by_text:
        log.warning("%d of %d streams reported usage only at the end: their TTFT and TPOT are timed from text chunks, which "
                    "may hold several tokens each (the server does not support stream_options.continuous_usage_stats)", by_text, len(records))
    return ReplayResult(label, records, wall)
