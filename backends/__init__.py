"""Backend registry: name -> backend class, imported lazily.

``auto`` picks cuda, then npu, then cpu. Device backends are imported only when
asked for, so importing ``backends`` never imports triton or torch_npu.
"""
from __future__ import annotations

import importlib
from typing import Any

# name -> (module, class). Immutable: the registry has no runtime mutation.
_BACKENDS: dict[str, tuple[str, str]] = {
    "cpu": ("backends.reference", "ReferenceBackend"),
    "cuda": ("backends.cuda.backend", "CudaBackend"),
    "npu": ("backends.ascend.backend", "AscendBackend"),
}
AUTO_ORDER = ("cuda", "npu", "cpu")
NAMES = tuple(_BACKENDS)


class BackendUnavailable(RuntimeError):
    """The backend exists but cannot run on this machine; the message says why in one line."""


def backend_class(name: str) -> Any:
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of: auto, {', '.join(NAMES)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def availability(name: str) -> tuple[bool, str]:
    """(available, one-line reason), without raising."""
    try:
        cls = backend_class(name)
    except ImportError as err:  # a module of ours failed to import: say so plainly
        return False, f"{name}: backend module failed to import: {err}"
    return cls.availability()


def resolve_name(name: str) -> str:
    """Map ``auto`` to the first available of cuda, npu, cpu; check other names exist."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            if availability(candidate)[0]:
                return candidate
        return "cpu"
    backend_class(name)
    return name


def get_backend(name: str = "auto", **kwargs: Any) -> Any:
    """Instantiate a backend; an unavailable one raises ``BackendUnavailable`` with its reason."""
    resolved = resolve_name(name)
    ok, reason = availability(resolved)
    if not ok:
        raise BackendUnavailable(reason)
    return backend_class(resolved)(**kwargs)
