"""The HTTP server of ``lorafleet serve``: uvicorn's, plus an engine drain at shutdown."""
from __future__ import annotations

import logging
import threading
from typing import Any

import uvicorn

from runtime.async_engine import STEP_GRACE_S
from runtime.shutdown_seconds import check_shutdown_seconds


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which also shuts the engine down as soon as its own shutdown begins.

    uvicorn stops accepting connections, then waits up to ``timeout_graceful_shutdown`` for the open
    ones and cancels their handlers after that: a request still running then would get a bare
    plain-text 500, or a stream cut without an error. So the engine is told at once (in a
    thread): it takes no new request, lets in-flight ones finish for ``drain_s``, and fails the
    rest while their handlers still run, so each client gets a 503 ``engine_unavailable`` (a
    stream: an error event, then [DONE]). A step still running when ``drain_s`` ends gets
    ``step_grace_s`` more before the engine gives up on it (``AsyncLLMEngine.shutdown``), so
    ``drain_s + step_grace_s`` must end inside uvicorn's window (``timeout_graceful_shutdown``;
    None: no window). Both must be numbers of seconds >= 0 (``check_shutdown_seconds``)."""

    def __init__(self, config: uvicorn.Config, engine: Any, drain_s: float, step_grace_s: float = STEP_GRACE_S) -> None:
        check_shutdown_seconds(drain_s=drain_s, step_grace_s=step_grace_s)
        window = config.timeout_graceful_shutdown
        if window is not None and drain_s + step_grace_s >= window:
            raise ValueError(f"drain_s + step_grace_s ({drain_s} + {step_grace_s} s) must end inside uvicorn's graceful shutdown "
                             f"window ({window} s): the engine fails the requests still in flight at that end, while their handlers still run")
        super().__init__(config)
        self._engine = engine
        self._drain_s = drain_s
        self._step_grace_s = step_grace_s
        self.drain: threading.Thread | None = None  # the engine's shutdown, once uvicorn's began

    async def shutdown(self, sockets: Any = None) -> None:
        logging.getLogger("lorafleet.serve").info(
            "lorafleet serve: stopping; shutting down the engine (requests in flight get up to %s s to finish)", self._drain_s)
        self.drain = self._engine.shutdown_in_background(self._drain_s, self._step_grace_s)
        await super().shutdown(sockets=sockets)
        if self.force_exit and self.config.lifespan != "off":
            # A second signal (force_exit): uvicorn skips the app's lifespan shutdown, and its task
            # is cancelled when the loop closes, which starlette logs as an ERROR traceback. The
            # app's lifespan holds nothing to wait for, so it is ended as on a first signal.
            await self.lifespan.shutdown()
