"""``lorafleet serve --ray``: start a local Ray (or join ``--ray-address``), deploy, block.

Ctrl-C or SIGTERM drains the application (``application.drain``: new requests and /health
get a 503 ``engine_unavailable``, requests in flight get ``DRAIN_S`` to finish, the rest a
503), then deletes it and its registry actor (the manifest in ``--registry-dir`` stays)
and, for a Ray started here, stops Ray; exit status 0. A second signal stops waiting for
the drain. A signal during start-up stops once the deployment is done (a second one at
once). Start-up errors print one line and exit 2.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

RAY_MISSING = "--ray needs the 'ray' extra: pip install -e '.[ray]' in the lorafleet checkout"
DEFAULT_REGISTRY_DIR = "lorafleet-registry"


class StartupInterrupted(BaseException):
    """A second signal while the application was still being deployed."""


class StopSignals:
    """SIGINT/SIGTERM handlers for the launcher's whole life once Ray runs.

    Installed right after ``ray.init``: Ray's own SIGTERM handler for a driver would end the
    process mid-start (``ray.shutdown`` then aborts with SIGABRT and Ray's agents stay behind).
    The first signal sets ``event``; a second one during start-up raises StartupInterrupted."""

    def __init__(self) -> None:
        self.count = 0
        self.event = threading.Event()
        self.starting = True
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        self.event.set()
        if self.starting and self.count > 1:
            raise StartupInterrupted()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _unreachable_gcs(address: str | None, timeout_s: float = 5.0) -> str | None:
    """For a ``HOST:PORT`` cluster address (not ``auto``, not ``ray://``, which fail on their own),
    why nothing answers there, or None: ``ray.init`` would retry such an address for minutes."""
    if not address or address == "auto" or "://" in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None  # ray.init's own error names a malformed address
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        return f"Ray cluster {address}: nothing answers there ({err.strerror or err}); is its head node up?"
    return None


def run_ray(settings: Any) -> int:
    try:
        import ray
        from ray import serve  # noqa: F401 - serve is part of the extra, check it too
    except ImportError:
        print(f"lorafleet serve: {RAY_MISSING}", file=sys.stderr)
        return 2
    if settings.server.port == 0:  # a single server binds it and says which port it got; Serve's proxy does not say
        print("lorafleet serve: --port 0 (any free port) does not work with --ray: Serve's HTTP proxy would listen on a port "
              "nobody is told; give the port to serve on", file=sys.stderr)  # fmt: skip
        return 2
    from runtime.config import ConfigError
    from runtime.distributed.application import DRAIN_S, DeployError, ScaleOutConfig, StartError, deploy, drain, stop
    from runtime.distributed.manifest import ManifestError, check_folder
    from runtime.distributed.registry_client import RegistryRestarted, ReplicasFailedToApply
    from runtime.server.admin_workers import AdminBusy
    from runtime.server.errors import APIError
    from runtime.commands.serve import loading_line, one_line_error
    from runtime.models.hf_config import load_model_config
    from runtime.lora.adapter import check_adapter_folder
    from runtime.models.loader import weight_files
    from runtime.tokenizer import tokenizer_file
    from runtime.server.serve_config import check_base_model_names

    declared = any(m.base_model_name for m in settings.lora_modules)
    if settings.lora_modules and (settings.server.served_model_name is None or declared):
        # The replicas register name and path only: check adapter and declared base names here, as
        # a single server does (reading the model's config.json when the served name is not given).
        try:
            model_name: str | None = load_model_config(settings.engine.model).name
        except (ConfigError, ValueError, OSError) as err:
            if declared:  # a declared base_model_name cannot be checked without it
                print(f"lorafleet serve: {err}", file=sys.stderr)
                return 2
            model_name = None  # not readable here (a remote cluster): only the replicas read the model
        if model_name is not None:
            try:
                check_base_model_names(settings.lora_modules, settings.server.served_model_name, model_name)
            except (ConfigError, ValueError) as err:
                print(f"lorafleet serve: {err}", file=sys.stderr)
                return 2

    registry_dir = str(Path(settings.registry_dir or DEFAULT_REGISTRY_DIR).expanduser().resolve())
    cfg = ScaleOutConfig(
        engine=settings.engine,
        server=settings.server,
        num_replicas=settings.num_replicas,
        registry_dir=registry_dir,
        initial_adapters=tuple((m.name, m.path) for m in settings.lora_modules),
        log_level=settings.log_level,
    )
    host, port = settings.server.host, settings.server.port
    started_here = settings.ray_address is None and not os.environ.get("RAY_ADDRESS")  # ray.init joins $RAY_ADDRESS's cluster
    if started_here:
        # Serve's proxy and the registry actor will run on this machine: find a busy port or an
        # unusable --registry-dir now, as a single server does, not after Ray has started.
        from runtime.commands.serve import bind_socket

        try:
            bind_socket(host, port).close()
        except OSError as err:
            print(f"lorafleet serve: cannot listen on {host}:{port}: {err.strerror or err}", file=sys.stderr)
            return 2
        try:
            restored = check_folder(registry_dir).by_name()
        except ManifestError as err:
            print(f"lorafleet serve: {err}", file=sys.stderr)
            return 2
        # The replicas will read the model and the adapters on this machine too: a missing folder, a config
        # that does not parse, pickled-only weights or no tokenizer.json are found now, not after Ray's start-up and in replica
        # tracebacks. (What the files hold is validated by a replica, for every adapter before any is recorded.)
        try:
            served = settings.server.served_model_name or load_model_config(settings.engine.model).name
            weight_files(settings.engine.model)
            tokenizer_file(settings.engine.model)
            for module in settings.lora_modules:
                check_adapter_folder(Path(module.path))
        except (ConfigError, ValueError, OSError) as err:
            print(f"lorafleet serve: {one_line_error(err)}", file=sys.stderr)
            return 2
        if served in restored:
            print(f"lorafleet serve: registry_dir {registry_dir}: adapter {served!r}, registered there earlier, has the served base "
                  "model's name, so requests for it would reach the base; choose another --served-model-name, or unload it from that "
                  "registry first", file=sys.stderr)  # fmt: skip
            return 2
    unreachable = _unreachable_gcs(settings.ray_address or os.environ.get("RAY_ADDRESS"))
    if unreachable:
        print(f"lorafleet serve: {unreachable}", file=sys.stderr)
        return 2
    print(loading_line(settings, replicas=settings.num_replicas), flush=True)  # Ray's start-up and the replicas' loads take minutes
    try:
        ray.init(address=settings.ray_address, include_dashboard=False, logging_level=settings.log_level.upper())
    except (ConnectionError, TimeoutError, ValueError) as err:  # no cluster there (or it did not answer), or a malformed address
        where = (f"--ray-address {settings.ray_address}" if settings.ray_address else
                 f"$RAY_ADDRESS {os.environ['RAY_ADDRESS']}" if os.environ.get("RAY_ADDRESS") else "starting a local Ray cluster")  # fmt: skip
        print(f"lorafleet serve: {where}: {err}", file=sys.stderr)
        return 2
    signals = StopSignals()
    deployed = True  # whether the finally below has an application to delete
    try:
        try:
            deploy(cfg)
        except StartError as err:  # raised before anything was deployed (e.g. Serve runs elsewhere on this cluster)
            deployed = False
            print(f"lorafleet serve: {err}", file=sys.stderr)
            return 2
        except (ManifestError, ValueError, DeployError) as err:
            print(f"lorafleet serve: {err}", file=sys.stderr)
            return 2
        except OSError as err:  # e.g. an initial adapter's file the validating replica may not read: as a single server says it
            print(f"lorafleet serve: {one_line_error(err)}", file=sys.stderr)
            return 2
        except ReplicasFailedToApply as err:  # an initial --lora-modules entry no replica could load
            detail = "; ".join(f"replica {rid}: {' | '.join(errs)}" for rid, errs in sorted(err.failed.items()))
            print(f"lorafleet serve: the initial adapters could not be applied ({detail}). They stay recorded in the "
                  f"registry at {registry_dir}: fix the files, or start with another --registry-dir", file=sys.stderr)  # fmt: skip
            return 2
        except RegistryRestarted as err:  # the registry actor restarted while an initial --lora-modules entry was applied
            print(f"lorafleet serve: the initial adapters are not recorded ({err.message}); start again", file=sys.stderr)
            return 2
        except (APIError, AdminBusy) as err:  # e.g. the replica validating one died (replica_unavailable), the registry is gone
            print(f"lorafleet serve: registering the initial adapters failed: {err.message if isinstance(err, APIError) else err}",
                  file=sys.stderr)  # fmt: skip
            return 2
        signals.starting = False
        if signals.event.is_set():
            print("lorafleet serve: stopped during start-up", file=sys.stderr, flush=True)
            return 0
        print(
            f"lorafleet serving on http://{host}:{port} "
            f"(Ray Serve app {cfg.app_name!r}, {cfg.num_replicas} replica(s), adapter registry {registry_dir}); Ctrl-C stops it",
            flush=True,
        )
        signals.event.wait()
        print(f"lorafleet serve: stopping; requests in flight get up to {DRAIN_S:.0f} s to finish (a second signal stops at once)", file=sys.stderr, flush=True)
        drain(cfg, DRAIN_S, interrupted=lambda: signals.count > 1)
        return 0
    except (StartupInterrupted, SystemError) as err:
        # A second signal while the main thread waits in ray.get comes back from Ray as a
        # SystemError whose context is the StartupInterrupted the handler raised.
        if not isinstance(err, StartupInterrupted) and not isinstance(err.__context__, StartupInterrupted):
            raise
        print("lorafleet serve: stopped during start-up", file=sys.stderr, flush=True)
        return 0
    finally:
        signals.starting = False
        try:
            if deployed:
                _stop_reporting_failure(stop, cfg)
            if started_here:
                ray.shutdown()
        finally:
            signals.restore()


def _stop_reporting_failure(stop: Any, cfg: Any) -> None:
    """``stop(cfg)`` (delete the Serve app and the registry actor); a failure there (the Serve
    controller already gone, e.g. after a SIGTERM to the whole process group) is one line on
    stderr, not a traceback that would also skip ``ray.shutdown`` and the signal handlers' restore."""
    from runtime.distributed.ray_failure import ray_failure

    try:
        stop(cfg)
    except Exception as err:  # noqa: BLE001 - reported, and the rest of the teardown still runs
        print(f"lorafleet serve: deleting the Serve app and its registry actor failed ({ray_failure(err)}); "
              "on a cluster joined with --ray-address they may be left running (docs/scale-out.md says how to remove them)",
              file=sys.stderr, flush=True)
