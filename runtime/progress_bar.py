"""ProgressBar: tqdm's bar on a terminal, plain progress lines anywhere else.

A bar redraws itself in place with carriage returns; in a CI log, ``2> file`` or a pipe every
redraw stays, so the log fills with ``\\r``-joined fragments. So on a stream whose ``isatty()``
is False the bar writes one newline-terminated line ``{desc}: {done}/{total} {unit} ({pct}%)``:

  * when it starts (``done`` = 0: the stage is named before its first item ends);
  * each time ``done`` enters a new tenth of ``total``, i.e. when ``tenth(done, total) =
    floor(10 * done / total)`` grows (one line, however many items one update adds);
  * at ``close()``, if the last line did not show the count reached.

That is at most 12 lines whatever the total, and none between the tenths, so a slow stage
writes little and a fast one no more. On a terminal it is tqdm's bar, unchanged.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from tqdm import tqdm

LINE_STEPS = 10  # the non-terminal lines: one per 1/LINE_STEPS of the total


def tenth(done: int, total: int) -> int:
    """How many whole tenths of ``total`` ``done`` has reached (``LINE_STEPS`` once done; a total of 0 is done)."""
    if total <= 0:
        return LINE_STEPS
    return min(LINE_STEPS, LINE_STEPS * max(0, done) // total)


class ProgressBar:
    """Counts ``total`` items of one stage on ``stream`` (default: ``sys.stderr`` when made).

    ``enabled=False`` writes nothing; ``None``: only on a terminal (tqdm's ``disable=None``). ``update(n=1)`` counts ``n`` more items (its no-argument
    form is the progress callback the bench replay takes); ``close()`` (or leaving a ``with``
    block) ends the bar. See the module docstring for what a non-terminal stream gets."""

    def __init__(self, total: int, desc: str, unit: str, stream: Any = None, enabled: Optional[bool] = True) -> None:
        self._stream = stream if stream is not None else sys.stderr
        terminal = _is_terminal(self._stream)
        enabled = terminal if enabled is None else enabled
        self._total, self._desc, self._unit = total, desc, unit
        self._done = 0
        self._closed = not enabled
        self._bar: Optional[tqdm] = None
        self._shown: Optional[int] = None  # the count the last plain line showed
        if not enabled:
            return
        if terminal:
            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self._stream)
        else:
            self._line()

    def update(self, n: int = 1) -> None:
        if self._closed:
            return
        before = self._done
        self._done += n
        if self._bar is not None:
            self._bar.update(n)
        elif tenth(self._done, self._total) > tenth(before, self._total):
            self._line()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._shown != self._done:
            self._line()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _line(self) -> None:
        pct = 100 if self._total <= 0 else 100 * self._done // self._total
        self._stream.write(f"{self._desc}: {self._done}/{self._total} {self._unit} ({pct}%)\n")
        self._stream.flush()
        self._shown = self._done


def _is_terminal(stream: Any) -> bool:
    """``stream.isatty()``; False for a stream without one or a closed one."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
