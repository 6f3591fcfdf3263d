"""The registry with thousands of adapters: messages and logs that name them stay short, and the
listing is kept up to date rather than rebuilt for every registration."""
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


def test_the_listing_follows_every_change() -> None:
    """infos() is kept per name, not rebuilt: re-registering at a new path, a new version,
    and unregistering each show at once."""
    registry = AdapterRegistry()
    for name in ("b", "a", "c"):
        registry.register(AdapterRef(name, "v1"), f"/{name}", 8)
    assert [(i.name, i.version, i.path) for i in registry.infos()] == [("a", "v1", "/a"), ("b", "v1", "/b"), ("c", "v1", "/c")]
    first = registry.infos()[1].registered_at
    registry.register(AdapterRef("b", "v1"), "/moved", 8)  # same content elsewhere: same version and time, new path
    registry.register(AdapterRef("c", "v2"), "/c2", 16)
    registry.unregister("a")
    infos = registry.infos()
    assert [(i.name, i.version, i.path, i.max_rank) for i in infos] == [("b", "v1", "/moved", 8), ("c", "v2", "/c2", 16)]
    assert infos[0].registered_at == first
