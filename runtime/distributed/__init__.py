"""Scale-out on Ray Serve: replicas with adapter-affinity routing and one shared adapter registry.

Needs the optional ``ray`` extra (``pip install -e '.[ray]'``). Modules:

    manifest         the persisted registry manifest (atomic JSON in a configurable folder)
    registry_service the application's adapter set with a revision number (runs as a Ray actor)
    registry_client  validate -> record -> wait until live replicas applied the revision
    registry_lookup  a starting ingress or replica finds the registry actor (a bounded wait, then one line)
    ray_failure      a Ray error in one line, for the CLI and API messages
    replica          the Serve deployment: one AsyncLLMEngine per replica, multiplexed by adapter
    replica_set      the engine-shaped proxy the ingress app is built around
    ingress          the ingress deployment: the same FastAPI app as ``lorafleet serve``
    application      build / deploy / stop the Serve application
    shutdown_timeouts the drain's and Serve's shutdown timeouts, and the check that they fit
    launcher         ``lorafleet serve --ray``

Nothing here imports ray at package import time, so ``runtime`` works without the extra.
"""
