"""docs/api.md's metrics table lists exactly the families ``/metrics`` exports, each with its
Prometheus type and labels, so a metric added, renamed or retyped in runtime/server/metrics.py
fails here until the table says so."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from runtime.server.metrics import ServerMetrics

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
ROW = re.compile(r"^\s*\| `(lorafleet_\w+)` \| (\w+) \|([^|]*)\|", re.MULTILINE)


def documented() -> dict[str, tuple[str, frozenset[str]]]:
    """Metric name as exported -> (type, labels) from the table's rows (a label's value list, in
    parentheses, is not a label)."""
    rows = {}
    for name, kind, labels in ROW.findall(API_DOC.read_text(encoding="utf-8")):
        rows[name] = (kind, frozenset(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", labels))))
    return rows


def exported() -> dict[str, tuple[str, frozenset[str]]]:
    """What a single server's /metrics renders once an adapter has had a request (every family
    then has a sample), as name -> (type, labels); prometheus_client's ``_created`` gauges aside."""
    snapshot = {"adapters": {"a": {"device_hits": 1}}}
    metrics = ServerMetrics(lambda: snapshot)
    metrics.observe(SimpleNamespace(adapter="a", finish_reason="stop", queue_time=0.1, output_tokens=2, prompt_tokens=3, ttft=0.1, tpot=0.1,
                                    adapter_wait=0.0))  # fmt: skip
    families = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.name.endswith("_created"):
            continue
        name = family.name + "_total" if family.type == "counter" else family.name  # the parser drops the suffix
        labels = frozenset(label for sample in family.samples for label in sample.labels if label != "le")
        families[name] = (family.type, labels)
    return families


def test_every_exported_metric_is_documented_with_its_type_and_labels() -> None:
    assert exported() == documented()
