"""lorafleet's log level inside Ray actors.

``lorafleet serve`` sets its level on the root logger of its own process (``logging.basicConfig``).
The ingress and the replicas run in Ray worker processes, whose loggers Ray sets up (root at
WARNING): there ``--log-level`` reached only Ray's own logger, so the request lines
(``lorafleet.requests``, at INFO, with ``user=``) were never written. Each actor calls
``apply_log_level`` with the level the launcher was given, on lorafleet's loggers only.
"""
from __future__ import annotations

import logging

LOG_LEVELS = ("debug", "info", "warning", "error")
LOGGER_NAMES = ("lorafleet", "runtime", "backends")  # named loggers and the modules' __name__ ones


def apply_log_level(level: str) -> None:
    """Set ``level`` (one of ``LOG_LEVELS``) on lorafleet's loggers in this process."""
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    for name in LOGGER_NAMES:
        logging.getLogger(name).setLevel(level.upper())
