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


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # lorafleet serve's own


def apply_log_level(level: str) -> None:
    """Set ``level`` (one of ``LOG_LEVELS``) on lorafleet's loggers in this process. Where the root
    logger has no handler (a Serve replica's), Python's last-resort handler would still print
    WARNING and up only: each of lorafleet's loggers then gets its own stderr handler (once),
    which Ray copies to the worker's log."""
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    needs_handler = not logging.getLogger().handlers
    for name in LOGGER_NAMES:
        logger = logging.getLogger(name)
        logger.setLevel(level.upper())
        if needs_handler and not any(getattr(h, "lorafleet_actor_handler", False) for h in logger.handlers):
            handler = logging.StreamHandler()  # sys.stderr at the time of each write
            handler.setFormatter(logging.Formatter(LOG_FORMAT))
            handler.lorafleet_actor_handler = True  # type: ignore[attr-defined]
            logger.addHandler(handler)
