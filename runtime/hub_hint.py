"""What to tell someone who gave a Hugging Face Hub id where lorafleet wants a local folder.

lorafleet reads checkpoints and adapters from local folders only; it never downloads. vLLM
takes ``--model meta-llama/Llama-3.2-1B`` and fetches it, so that is often the first thing a
user types. A missing folder whose path, relative to the current directory, is two names of
Hub-id characters (``owner/name``) may be meant as one: the error then says how to get it.
"""
from __future__ import annotations

import re
from pathlib import Path

_HUB_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def hub_id_in(path: str | Path) -> str | None:
    """``owner/name`` when ``path`` (relative, or absolute under the current directory, as
    ``lorafleet serve`` makes adapter paths) reads as a Hub repository id, else None."""
    p = Path(path)
    if p.is_absolute():
        try:
            p = p.relative_to(Path.cwd())
        except ValueError:
            return None
    parts = p.parts
    if len(parts) != 2 or not all(_HUB_PART.fullmatch(part) for part in parts):
        return None
    return "/".join(parts)


def hub_download_hint(path: str | Path) -> str:
    """A clause to append to a "no such folder" error (``; lorafleet reads ...``), or "" when
    ``path`` does not read as a Hub id."""
    repo = hub_id_in(path)
    if repo is None:
        return ""
    return (f"; lorafleet reads local folders only and downloads nothing: if {repo!r} is a Hugging Face Hub id, "
            f"download it first (`hf download {repo} --local-dir DIR`, huggingface_hub's CLI) and give DIR")
