"""Byte sizes as operators write them: ``512M``, ``2G``, ``1.5GiB``, or plain bytes (``1048576``).

The units are binary (K = 2**10, M = 2**20, G = 2**30, T = 2**40), as the memory they size is
counted: ``2G`` is 2 GiB. ``2GB`` is refused rather than guessed, because it reads as 2 * 10**9
as often as 2 GiB; the error says what to write instead. A fraction is rounded down to whole
bytes (``1.5K`` is 1536).
"""
from __future__ import annotations

import re

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:iB)?|B)?\s*$", re.IGNORECASE)
_AMBIGUOUS = re.compile(r"^\s*\d+(?:\.\d+)?\s*[KMGT]B\s*$", re.IGNORECASE)


def parse_byte_size(text: str | int) -> int:
    """``text`` in bytes: an int as it is, a string as described above. ValueError (one line,
    quoting ``text``) for anything else, a negative number included."""
    if isinstance(text, bool):  # YAML's true is an int to Python, not a size
        raise ValueError(f"expected a size such as 512M, 2G or a number of bytes, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"expected a size of at least 0 bytes, got {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"expected a size such as 512M, 2G or a number of bytes, got {text!r}")
    if _AMBIGUOUS.match(text):
        binary = "".join(text.split())[:-1]  # "2 GB" -> "2G"
        raise ValueError(f"{text!r} is ambiguous (10**9 or 2**30 bytes?): write {binary} or {binary}iB for binary units, or the number of bytes")
    found = _SIZE.match(text)
    if found is None:
        raise ValueError(f"expected a size such as 512M, 2G or a number of bytes, got {text!r}")
    number, unit = found.groups()
    scale = UNITS[(unit or "").upper()]
    return int(float(number) * scale) if "." in number else int(number) * scale


def format_byte_size(n: int) -> str:
    """``n`` bytes for a message: the largest binary unit that keeps at least 1 (``2.0 GiB``,
    ``512.0 MiB``, ``100 bytes``)."""
    for unit, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n} bytes"
