"""Messages and logs that name adapters stay short with thousands registered."""
from __future__ import annotations

import types

import pytest

from runtime.commands.serve import _adapters_line
from runtime.lora.registry import AdapterRegistry, some_names
from runtime.request import AdapterRef, UnknownAdapterError


def test_some_names_lists_ten_then_counts() -> None:
    assert some_names([]) == "none"
    assert some_names(["b", "a"]) == "a, b"
    names = [f"a{i:04d}" for i in range(2000)]
    text = some_names(reversed(names))
    assert text.startswith("a0000, a0001") and "a0009 and 1990 more" in text and "a0010" not in text


def test_an_unknown_name_among_thousands_gets_a_short_404_message() -> None:
    registry = AdapterRegistry()
    for i in range(2000):
        registry.register(AdapterRef(f"adapter-{i:04d}", "v"), f"/adapters/{i}", 8)
    for call in (registry.resolve, registry.unregister):
        with pytest.raises(UnknownAdapterError) as err:
            call("adapter-typo")
        assert len(str(err.value)) < 300 and "1990 more" in str(err.value)


def test_the_start_up_summary_lists_ten_adapters() -> None:
    adapters = [types.SimpleNamespace(name=f"a{i}", version="v1", max_rank=8) for i in range(2000)]
    line = _adapters_line(adapters)
    assert line.startswith("2000: a0@v1 r=8") and line.endswith("and 1990 more (GET /v1/models lists them)") and len(line) < 300
    assert _adapters_line(adapters[:2]) == "a0@v1 r=8, a1@v1 r=8"
    assert _adapters_line([]) == "none"
