"""Declared fallbacks, counted every time and logged once per reason.

The once-state lives in this object, which the backend owns: there is no module-global
"already warned" set, so two backends (or two tests) never share it.
"""
from __future__ import annotations

import logging

LOGGER = logging.getLogger("lorafleet.backends.ascend")


class FallbackLog:
    """``note(reason, detail)``: count ``reason``; log ``detail`` the first time only."""

    def __init__(self, logger: logging.Logger = LOGGER) -> None:
        self._logger = logger
        self.counts: dict[str, int] = {}

    def note(self, reason: str, detail: str) -> None:
        first = reason not in self.counts
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if first:
            self._logger.warning("npu fallback [%s]: %s (logged once per reason)", reason, detail)
