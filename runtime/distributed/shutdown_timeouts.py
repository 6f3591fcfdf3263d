"""How long the Ray application's shutdown may take, and the check that its parts fit together.

Shutdown: requests in flight get DRAIN_S to finish (a single server's ENGINE_DRAIN_S); a step
still running then gets STEP_GRACE_S more before the replica's engine gives up on
it and fails its requests (AsyncLLMEngine.shutdown); the ingress waits up to DRAIN_MARGIN_S past
the drain (more than that grace) to pass the last outputs and errors on. Serve's graceful
shutdown of a replica waits for its requests in flight, then kills it: longer than the drain and
the step grace, and the ingress's longer than the replicas', so a request cut by that kill still
gets its 503.

``check_shutdown_timeouts`` checks these relations, before anything begins, at every public entry
of a drain: ``application.build`` (for ``DRAIN_S``), ``application.drain``,
``LoraIngress.begin_shutdown`` (a script may call it through a Serve handle, without ``drain``) and
``AdapterRegistryService.begin_drain``, the ingress's call to the registry, which a script may make
too (the registry is a named actor): a drain it took unchecked went to every replica's engine. This
module needs no torch (``STEP_GRACE_S`` is in ``runtime/shutdown_seconds.py``), which the registry
actor does not load.
"""
from __future__ import annotations

from runtime.shutdown_seconds import STEP_GRACE_S, check_shutdown_seconds

DRAIN_S = 25.0
DRAIN_MARGIN_S = 5.0
REPLICA_GRACEFUL_SHUTDOWN_S = 30.0
INGRESS_GRACEFUL_SHUTDOWN_S = 40.0


def check_shutdown_timeouts(drain_s: float, step_grace_s: float = STEP_GRACE_S) -> None:
    """ValueError unless a drain of ``drain_s`` fits Serve's graceful shutdown timeouts, as
    ``DrainingServer`` checks uvicorn's window for a single server:
    ``drain_s + step_grace_s < REPLICA_GRACEFUL_SHUTDOWN_S`` (a replica's engine fails what is left,
    a stuck step's requests included, before Serve kills the replica), ``step_grace_s <
    DRAIN_MARGIN_S`` (``drain`` waits for those 503s to pass the ingress) and
    ``REPLICA_GRACEFUL_SHUTDOWN_S < INGRESS_GRACEFUL_SHUTDOWN_S`` (the ingress relays them).
    Each length must be a number of seconds >= 0 (``check_shutdown_seconds``): a negative or NaN
    ``drain_s`` is refused too, not handed to the replicas' engines."""
    check_shutdown_seconds(drain_s=drain_s, step_grace_s=step_grace_s)
    if not drain_s + step_grace_s < REPLICA_GRACEFUL_SHUTDOWN_S:
        raise ValueError(f"drain_s + step_grace_s ({drain_s} + {step_grace_s} s) must end inside the replicas' graceful shutdown timeout "
                         f"({REPLICA_GRACEFUL_SHUTDOWN_S} s): their engines fail the requests still in flight at that end, before Serve kills them")
    if not step_grace_s < DRAIN_MARGIN_S:
        raise ValueError(f"step_grace_s ({step_grace_s} s) must be shorter than DRAIN_MARGIN_S ({DRAIN_MARGIN_S} s), the ingress's wait past the drain "
                         f"for the replicas' last outputs and errors")
    if not REPLICA_GRACEFUL_SHUTDOWN_S < INGRESS_GRACEFUL_SHUTDOWN_S:
        raise ValueError(f"the ingress's graceful shutdown timeout ({INGRESS_GRACEFUL_SHUTDOWN_S} s) must be longer than the replicas' "
                         f"({REPLICA_GRACEFUL_SHUTDOWN_S} s): it relays what they send until they stop")
