"""Server options (frozen): everything ``lorafleet serve`` needs besides the engine config."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# An adapter's name in the API: what the admin route accepts, and what --lora-modules must give too,
# so that every served adapter can be listed, hot-updated and unloaded (and labels metrics safely).
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"
ADAPTER_NAME_MAX_LEN = 128
# The same rule in words, for the errors of the admin route and of --lora-modules.
ADAPTER_NAME_RULE = f"1-{ADAPTER_NAME_MAX_LEN} letters, digits, '.', '_' or '-', starting with a letter or digit"


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` follows ``ADAPTER_NAME_RULE`` (``ADAPTER_NAME_PATTERN``, at most ``ADAPTER_NAME_MAX_LEN`` characters)."""
    return len(name) <= ADAPTER_NAME_MAX_LEN and re.fullmatch(ADAPTER_NAME_PATTERN, name) is not None


@dataclass(frozen=True)
class ServerOptions:
    """
    host, port:            where uvicorn listens (default loopback only)
    served_model_name:     the base model's name in the API; None = the engine's model name
    enable_adapter_admin:  expose /v1/load_lora_adapter and /v1/unload_lora_adapter
    api_key:               when set, every route but /health needs ``Authorization: Bearer <key>``
    adapter_roots:         folders that admin-loaded adapter paths must resolve into
    max_request_bytes:     largest accepted request body
    metrics_max_adapters:  adapters with series of their own in /metrics (the first to get a
                           request); the others share ``adapter="__other__"``
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    enable_adapter_admin: bool = False
    api_key: str | None = field(default=None, repr=False)  # a secret: kept out of repr(), and so out of logs and tracebacks
    adapter_roots: tuple[Path, ...] = field(default_factory=tuple)
    max_request_bytes: int = 1 << 20
    metrics_max_adapters: int = 100
