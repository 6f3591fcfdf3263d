"""docs/api.md's metrics table lists exactly the families ``/metrics`` exports, each with its
Prometheus type and labels, so a metric added, renamed or retyped in runtime/server/metrics.py
fails here until the table says so."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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


def rendered() -> list[Any]:
    """The metric families a single server's /metrics renders once an adapter has had a request
    (every family then has a sample)."""
    snapshot = {"adapters": {"a": {"device_hits": 1}}}
    metrics = ServerMetrics(lambda: snapshot)
    metrics.observe(SimpleNamespace(adapter="a", finish_reason="stop", queue_time=0.1, output_tokens=2, prompt_tokens=3, ttft=0.1, tpot=0.1,
                                    adapter_wait=0.0))  # fmt: skip
    return list(text_string_to_metric_families(metrics.render().decode()))


def exported() -> dict[str, tuple[str, frozenset[str]]]:
    """``rendered()`` as name -> (type, labels); prometheus_client's ``_created`` gauges aside."""
    families = {}
    for family in rendered():
        if family.name.endswith("_created"):
            continue
        name = family.name + "_total" if family.type == "counter" else family.name  # the parser drops the suffix
        labels = frozenset(label for sample in family.samples for label in sample.labels if label != "le")
        families[name] = (family.type, labels)
    return families


def test_every_exported_metric_is_documented_with_its_type_and_labels() -> None:
    assert exported() == documented()


def exported_created() -> set[str]:
    """The names of the ``_created`` gauges in ``rendered()``."""
    return {family.name for family in rendered() if family.name.endswith("_created")}


def test_created_gauges_are_the_first_seven_rows_and_named_as_exported() -> None:
    """The doc's sentence after the table: the first seven rows have ``_created`` gauges, and a
    counter's is named without its ``_total`` (``lorafleet_requests_created``, not
    ``lorafleet_requests_total_created``); every such name it writes is one /metrics exports."""
    text = API_DOC.read_text(encoding="utf-8")
    first_seven = list(documented())[:7]
    assert exported_created() == {name.removesuffix("_total") + "_created" for name in first_seven}
    named = set(re.findall(r"`(lorafleet_\w+_created)`", text))
    assert named <= exported_created()
    assert {name.removesuffix("_total") + "_created" for name in first_seven if name.endswith("_total")} <= named
