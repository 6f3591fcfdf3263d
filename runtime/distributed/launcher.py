"""``lorafleet serve --ray``: start a local Ray (or join ``--ray-address``), deploy, block.

Ctrl-C or SIGTERM deletes the application and its registry actor (the manifest in
``--registry-dir`` stays) and, for a Ray started here, stops Ray.
"""
from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

RAY_MISSING = "--ray needs the 'ray' extra: pip install 'lorafleet[ray]'"
DEFAULT_REGISTRY_DIR = "lorafleet-registry"


def run_ray(settings: Any) -> int:
    try:
        import ray
        from ray import serve  # noqa: F401 - serve is part of the extra, check it too
    except ImportError:
        print(f"lorafleet serve: {RAY_MISSING}", file=sys.stderr)
        return 2
    from runtime.config import ConfigError
    from runtime.distributed.application import ScaleOutConfig, deploy, stop
    from runtime.distributed.manifest import ManifestError
    from runtime.models.hf_config import load_model_config
    from runtime.server.serve_config import check_base_model_names

    from runtime.distributed.registry_client import ReplicasFailedToApply

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
    )
    started_here = settings.ray_address is None
    try:
        ray.init(address=settings.ray_address, include_dashboard=False, logging_level=settings.log_level.upper())
    except (ConnectionError, TimeoutError, ValueError) as err:  # no cluster there (or it did not answer), or a malformed address
        where = f"--ray-address {settings.ray_address}" if settings.ray_address else "starting a local Ray cluster"
        print(f"lorafleet serve: {where}: {err}", file=sys.stderr)
        return 2
    stopped = threading.Event()
    try:
        try:
            deploy(cfg)
        except (ManifestError, ValueError) as err:
            print(f"lorafleet serve: {err}", file=sys.stderr)
            return 2
        except ReplicasFailedToApply as err:  # an initial --lora-modules entry no replica could load
            detail = "; ".join(f"replica {rid}: {' | '.join(errs)}" for rid, errs in sorted(err.failed.items()))
            print(f"lorafleet serve: the initial adapters could not be applied ({detail}). They stay recorded in the "
                  f"registry at {registry_dir}: fix the files, or start with another --registry-dir", file=sys.stderr)  # fmt: skip
            return 2
        print(
            f"lorafleet serving on http://{settings.server.host}:{settings.server.port} "
            f"(Ray Serve app {cfg.app_name!r}, {cfg.num_replicas} replica(s), adapter registry {registry_dir}); Ctrl-C stops it",
            flush=True,
        )
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopped.set())
        stopped.wait()
        return 0
    finally:
        stop(cfg)
        if started_here:
            ray.shutdown()
