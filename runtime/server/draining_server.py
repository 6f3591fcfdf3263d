"""The HTTP server of ``lorafleet serve``: uvicorn's, plus an engine drain at shutdown."""
from __future__ import annotations

import logging
import threading
from typing import Any

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which also shuts the engine down as soon as its own shutdown begins.

    uvicorn stops accepting connections, then waits up to ``timeout_graceful_shutdown`` for the open
    ones and cancels their handlers after that: a request still running then would get a bare
    plain-text 500, or a stream cut without an error. So the engine is told at once (in a
    thread): it takes no new request, lets in-flight ones finish for ``drain_s``, a few
    seconds inside uvicorn's window, and fails the rest while their handlers still run, so
    each client gets a 503 ``engine_unavailable`` (a stream: an error event, then [DONE])."""

    def __init__(self, config: uvicorn.Config, engine: Any, drain_s: float) -> None:
        if drain_s >= (config.timeout_graceful_shutdown or float("inf")):
            raise ValueError(f"drain_s ({drain_s}) must end inside uvicorn's graceful shutdown window ({config.timeout_graceful_shutdown} s)")
        super().__init__(config)
        self._engine = engine
        self._drain_s = drain_s
        self.drain: threading.Thread | None = None  # the engine's shutdown, once uvicorn's began

    async def shutdown(self, sockets: Any = None) -> None:
        logging.getLogger("lorafleet.serve").info(
            "lorafleet serve: stopping; shutting down the engine (requests in flight get up to %s s to finish)", self._drain_s)
        self.drain = self._engine.shutdown_in_background(self._drain_s)
        await super().shutdown(sockets=sockets)
        if self.force_exit and self.config.lifespan != "off":
            # A second signal (force_exit): uvicorn skips the app's lifespan shutdown, and its task
            # is cancelled when the loop closes, which starlette logs as an ERROR traceback. The
            # app's lifespan holds nothing to wait for, so it is ended as on a first signal.
            await self.lifespan.shutdown()
