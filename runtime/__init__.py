"""lorafleet runtime: everything device-independent.

``from runtime import LLM, SamplingParams`` works, but the names are resolved lazily
(PEP 562) so ``import runtime`` does not import torch or the model code.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LLM": "runtime.llm",
    "CompletionResult": "runtime.llm",
    "GenerationError": "runtime.llm",
    "SamplingParams": "runtime.request",
    "LLMEngine": "runtime.engine",
    "AsyncLLMEngine": "runtime.async_engine",
    "EngineConfig": "runtime.config",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
