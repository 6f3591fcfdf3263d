"""FastAPI app factory: OpenAI-compatible routes, adapter admin, health and metrics.

``create_app(engine, options)`` builds an app around an already-constructed async
engine, so tests run it in-process and the Ray deployment reuses the same routes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from runtime.async_engine import EngineDeadError
from runtime.daemon_executor import DaemonExecutor
from runtime.server import admin, chat, completions, tokenize
from runtime.server.admin_workers import ADMIN_MAX_IN_PROGRESS, ADMIN_THREADS, AdminWorkers
from runtime.server.chat_render_workers import CHAT_RENDER_MAX_IN_PROGRESS, CHAT_RENDER_THREADS, ChatRenderWorkers
from runtime.server.errors import error_response, install_error_handlers, install_openapi_errors
from runtime.server.metrics import ServerMetrics
from runtime.server.options import ServerOptions
from runtime.server.security import GuardMiddleware

server_log = logging.getLogger("lorafleet.server")  # errors.py's: what the operator should look at
METRICS_THREADS = 2  # /metrics renders at once (a scrape waits for the engine lock: at most one step); more queue for a thread


def unavailable_reason(engine: Any) -> str | None:
    """Why the engine cannot take requests (it died, or is shutting down), or None. Takes no lock.

    An engine without ``dead_error``/``accepting`` is always available. (A Ray replica set
    has both: unavailable while the application starts and once it shuts down.)
    """
    dead = getattr(engine, "dead_error", None)
    if dead is not None:
        return f"engine unavailable: {dead}"
    if not getattr(engine, "accepting", True):
        return "engine unavailable: it is shutting down; no new requests are accepted"
    return None


def sequence_token_limit(engine: Any) -> int:
    """Most tokens (prompt + output) one request can have: max_model_len, or what the KV pool
    holds for one sequence (num_kv_blocks * block_size) when that is less. An engine spread over
    replicas (Ray) has no pool of its own: it reports its replicas' limit as ``max_seq_tokens``."""
    reported = getattr(engine, "max_seq_tokens", None)
    if reported is not None:
        return min(engine.max_model_len, reported)
    block_size = getattr(getattr(engine, "config", None), "block_size", None)
    blocks = engine.snapshot().get("kv_blocks_total") if block_size else None
    return min(engine.max_model_len, blocks * block_size) if blocks else engine.max_model_len


@dataclass
class AppState:
    """What the routes need, held by one app (no module globals).

    max_seq_tokens: ``sequence_token_limit``; a request without max_tokens gets its default
    capped to what its prompt leaves of it.
    chat_renders: the threads chat templates render in (chat completions, ``/tokenize`` of
    messages), shut down with the app (its lifespan's end); a call after that starts new threads.
    admin_workers: the threads the admin routes read and install adapters in, likewise.
    metrics_threads: the threads /metrics renders in. Its engine snapshot takes the engine lock, so
    a render can be the lock's holder that a shutdown gives up on (a hung device): daemon threads
    (``DaemonExecutor``; the event loop's default executor is joined at exit), which end with the app.
    """

    engine: Any
    options: ServerOptions
    base_name: str
    tokenizer: Any
    max_model_len: int
    max_seq_tokens: int
    metrics: ServerMetrics
    started: int
    chat_renders: ChatRenderWorkers
    admin_workers: AdminWorkers
    metrics_threads: DaemonExecutor


def create_app(
    engine: Any,
    options: ServerOptions | None = None,
    replica: str | None = None,
    replica_snapshots: Callable[[], dict[str, dict[str, Any]]] | None = None,
    fold_replica_counters: Callable[[str, list[str]], None] | None = None,
) -> FastAPI:
    """``replica_snapshots``: for an engine spread over replicas (Ray Serve), replica id ->
    engine snapshot; /metrics then reports pool/KV/adapter series per replica, and hands each
    replica's names past the label cap to ``fold_replica_counters`` (``ServerMetrics``)."""
    options = options or ServerOptions()
    base_name = options.served_model_name or engine.model_name
    metrics = ServerMetrics(engine.snapshot, replica=replica, replica_snapshots=replica_snapshots, max_adapters=options.metrics_max_adapters,
                            fold_counters=getattr(engine, "fold_adapter_counters", None), fold_replica_counters=fold_replica_counters)
    engine.add_observer(metrics.observe)
    problem = getattr(engine.tokenizer, "chat_template_problem", None)
    if problem is not None:  # the server still serves completions; chat requests get a 500 saying why (generation.render_chat)
        server_log.warning("the chat template cannot be used, so chat completions (and /tokenize of messages) will fail with a 500 "
                           "until it is fixed: %s", problem)
    state = AppState(
        engine=engine,
        options=options,
        base_name=base_name,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        max_seq_tokens=sequence_token_limit(engine),
        metrics=metrics,
        started=int(time.time()),
        chat_renders=ChatRenderWorkers(CHAT_RENDER_THREADS, CHAT_RENDER_MAX_IN_PROGRESS),
        admin_workers=AdminWorkers(ADMIN_THREADS, ADMIN_MAX_IN_PROGRESS),
        metrics_threads=DaemonExecutor(METRICS_THREADS, "lorafleet-metrics"),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            state.chat_renders.shutdown()
            state.admin_workers.shutdown()

    app = FastAPI(title="lorafleet", version="0.1.0", description="OpenAI-compatible multi-LoRA serving.", lifespan=lifespan)
    app.state.lorafleet = state
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=options.api_key, max_request_bytes=options.max_request_bytes)

    @app.get("/health", tags=["ops"])
    async def health() -> Any:
        problem = unavailable_reason(engine)
        if problem is not None:
            return error_response(503, problem, code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/metrics", tags=["ops"], response_class=Response)
    async def prometheus_metrics() -> Response:
        # The engine snapshot takes the engine lock (held for a whole step): wait for it off the event loop.
        try:
            body = await asyncio.get_running_loop().run_in_executor(state.metrics_threads, metrics.render)
        except EngineDeadError as err:  # shutdown gave up on a stuck step: its lock refuses everyone
            return error_response(503, f"engine unavailable: {err}", code="engine_unavailable")
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_cards() -> list[dict[str, Any]]:
        """The base model's card, then each adapter's (vLLM's fields: ``root``, ``parent``, ``max_model_len``).
        ``created``: when the server started, for the base; when its current version was
        registered, for an adapter."""
        # engine.adapters() takes no lock (see runtime/async_engine.py): this never waits for a step.
        card = {"object": "model", "created": state.started, "owned_by": "lorafleet", "max_model_len": state.max_model_len}
        base = {"id": base_name, **card, "root": base_name, "parent": None}
        return [base, *({"id": a.name, **card, **({"created": int(a.registered_at)} if a.registered_at else {}), "root": str(a.path),
                         "parent": base_name, "version": a.version} for a in engine.adapters())]  # fmt: skip

    @app.get("/v1/models", tags=["openai"])
    async def list_models() -> Any:
        return JSONResponse({"object": "list", "data": model_cards()})

    @app.get("/v1/models/{model_id:path}", tags=["openai"])
    async def retrieve_model(model_id: str) -> Any:
        for card in model_cards():
            if card["id"] == model_id:
                return JSONResponse(card)
        return error_response(404, f"model {model_id!r} does not exist; GET /v1/models lists the served ones", param="model", code="model_not_found")

    app.include_router(completions.build_router(state))
    app.include_router(chat.build_router(state))
    app.include_router(tokenize.build_router(state))
    app.include_router(admin.build_router(state) if options.enable_adapter_admin else admin.build_disabled_router())
    install_openapi_errors(app)
    return app
