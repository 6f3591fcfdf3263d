"""A replica's heartbeat report, sent as what changed since the report the registry holds.

The report (``LoraReplica.report``) is the engine snapshot plus ``registered``; two of its
fields are maps keyed by adapter name (``MAP_KEYS``: ``adapters``, the per-adapter counters,
and ``registered``, name -> version). Sent whole, every heartbeat (4 a second per replica)
carried every registered adapter's entries, so the registry's load grew as adapters x replicas
even with nothing changing. Now:

- the replica (``ReportSender``) sends each map as ``{"changed": {name: value}, "removed":
  [name]}``, the entries that differ from the report the registry acknowledged holding, under
  that report's number (``base``); the other fields, a few numbers, go whole every time;
- the registry (``apply_report``) rebuilds the whole report from the one it holds, when it holds
  report ``base`` of that replica; else (it restarted, it forgot the replica, a reply was lost)
  it refuses, and the replica sends the whole report at once.

So a heartbeat carries entries only for the adapters whose counters moved (the ones used since
the last heartbeat) or that were registered, updated or unregistered since.
"""
from __future__ import annotations

from typing import Any, Optional

MAP_KEYS = ("adapters", "registered")


class ReportSender:
    """The replica's side: what its registry acknowledged holding (the report's number and maps)."""

    def __init__(self) -> None:
        self._acked: Optional[tuple[int, dict[str, dict[str, Any]]]] = None

    def outgoing(self, report: dict[str, Any]) -> tuple[dict[str, Any], Optional[int]]:
        """``report`` as a heartbeat carries it, and its ``base``: the number of the acknowledged
        report its maps are changes to; None (no report acknowledged) for the whole report."""
        if self._acked is None:
            return report, None
        number, held = self._acked
        wire = dict(report)
        for key in MAP_KEYS:
            new, old = report.get(key, {}), held.get(key, {})
            wire[key] = {"changed": {k: v for k, v in new.items() if k not in old or old[k] != v}, "removed": [k for k in old if k not in new]}
        return wire, number

    def acknowledged(self, report: dict[str, Any], number: Optional[int]) -> None:
        """The registry holds ``report`` (whole, as ``outgoing`` was given it) as its report
        ``number``; None: it holds none of this replica's (the next report goes whole)."""
        self._acked = None if number is None else (number, {key: dict(report.get(key, {})) for key in MAP_KEYS})

    def forget(self) -> None:
        """A heartbeat failed: whether the registry took it is unknown, so the next report goes whole."""
        self._acked = None


def apply_report(held: Optional[dict[str, Any]], wire: dict[str, Any], base: Optional[int], held_number: Optional[int]) -> Optional[dict[str, Any]]:
    """The registry's side: the whole report ``wire`` stands for, or None when it cannot be rebuilt.

    ``base`` None: ``wire`` is whole. Else its ``MAP_KEYS`` hold changes to report ``base``, which
    must be ``held`` (``held_number == base``)."""
    if base is None:
        return wire
    if held is None or held_number != base:
        return None
    whole = dict(wire)
    for key in MAP_KEYS:
        delta = wire.get(key) or {"changed": {}, "removed": []}
        removed = set(delta["removed"])
        merged = {k: v for k, v in held.get(key, {}).items() if k not in removed}
        merged.update(delta["changed"])
        whole[key] = merged
    return whole
