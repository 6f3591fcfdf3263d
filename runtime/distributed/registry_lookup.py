"""find_registry: the application's registry actor for a starting ingress or replica, waited for a while.

Both deployments look the named registry actor up in their constructor. ``deploy`` creates it
first, but it can be gone when Serve (re)starts one of them: stopped (``ray.kill``), or a restart
that failed, or, for a RayService, not created yet (``start_registry`` is the operator's step). The
lookup raised Ray's ``ValueError`` ("Failed to look up actor with name ..."), the constructor
failed at once, and Serve started it again and again, a traceback in the logs each time, without
saying what to do. Now the constructor waits up to ``REGISTRY_WAIT_S`` (one log line says so), so a
registry created meanwhile is found; then it fails with ``RegistryMissing``, one line that names the
actor and what to do. ``deploy`` shows that line as its start-up error (``deploy_failure``: Serve
gives up after 3 failed starts); on a running application Serve keeps retrying, each retry logging
that line.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

import ray

logger = logging.getLogger("lorafleet.registry")

REGISTRY_WAIT_S = 10.0  # how long a starting ingress or replica waits for a missing registry actor
REGISTRY_POLL_S = 0.5  # how often it looks again meanwhile


class RegistryMissing(RuntimeError):
    """The application's registry actor is not running (the message is one line)."""


async def find_registry(name: str, namespace: str, wait_s: Optional[float] = None, poll_s: Optional[float] = None,
                        clock: Callable[[], float] = time.monotonic) -> Any:
    """The handle of registry actor ``name`` in ``namespace``; if it is not there, look again every
    ``poll_s`` (None: ``REGISTRY_POLL_S``) for up to ``wait_s`` (None: ``REGISTRY_WAIT_S``; one WARNING
    line when the wait begins), then ``RegistryMissing``."""
    wait_s = REGISTRY_WAIT_S if wait_s is None else wait_s
    poll_s = REGISTRY_POLL_S if poll_s is None else poll_s
    deadline = None
    while True:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError as err:  # Ray's answer for a name no live actor has
            now = clock()
            if deadline is None:
                deadline = now + wait_s
                logger.warning("the adapter registry actor %r (namespace %r) is not running; waiting up to %g s for it", name, namespace, wait_s)
            if now >= deadline:
                raise RegistryMissing(
                    f"the adapter registry actor {name!r} (namespace {namespace!r}) is not running (waited {wait_s:g} s): it was stopped, "
                    f"or could not restart; start the application again (lorafleet serve --ray, or application.deploy; for a RayService, "
                    f"application.start_registry first)") from err  # fmt: skip
        await asyncio.sleep(poll_s)
