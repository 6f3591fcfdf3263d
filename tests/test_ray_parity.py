"""The Ray application where it answered otherwise than a single server, or started and stopped
less cleanly: a draining replica's refusal, a missing registry actor at start-up, a restarted
registry's entry with other ``--adapter-root`` folders, the registry's own check of a drain, and a
replica's teardown. No Ray cluster: the replica, registry and ingress of ``test_ray_sync``'s
fixtures and helpers, called in process."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from runtime.distributed.shutdown_timeouts import check_shutdown_timeouts  # noqa: E402
from tests.test_ray_sync import (  # noqa: E402,F401 - fixtures and helpers shared with the sync tests
    service,
)

pytestmark = pytest.mark.ray


# ---- the registry checks a drain it is asked for, as the ingress does -----------------------------
@pytest.mark.parametrize("drain_s", [-5.0, float("nan"), 100.0, "20"], ids=["negative", "nan", "past-serve-s-timeout", "a-string"])
def test_the_registry_refuses_a_drain_the_ingress_would_refuse(service, drain_s) -> None:
    """``begin_drain`` is a call of a named actor that a script can make, not only the ingress after
    its check: it took a negative or NaN drain as none at all (the replicas cut their requests at
    once) and one longer than Serve's graceful shutdown timeout as it was. Now it refuses them with
    the ingress's own ValueError, and no drain begins."""
    with pytest.raises(ValueError) as ingress_says:
        check_shutdown_timeouts(drain_s)
    with pytest.raises(ValueError) as refused:
        service.begin_drain(drain_s)
    assert str(refused.value) == str(ingress_says.value)
    assert service.drain_left() is None and service.heartbeat("r1", -1, {})["drain_s"] is None


def test_the_registry_module_still_loads_without_torch() -> None:
    """The registry actor does not load torch; the drain check it now makes must not bring it in."""
    code = "import sys, runtime.distributed.registry_service; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
    assert out.stdout.strip() == "False", out.stderr


