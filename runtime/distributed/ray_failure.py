"""ray_failure: a Ray error in one line, for messages that reach a CLI user or an API client.

A ``RayTaskError`` (the remote call raised) prints as the remote traceback, many lines with
process ids and file paths; Ray also raises it as an instance of the cause's class (an OSError
there is an OSError here), so it must be answered before a handler for that class takes it. A
``RayActorError`` (the actor died) prints as Ray's paragraph about the death.
"""
from __future__ import annotations


def ray_failure(err: BaseException) -> str:
    """``err``, a Ray error, in one line: the type and first line of what the remote call raised
    (a ``RayTaskError`` carries it as ``cause``; its own text is the remote traceback), else of
    ``err`` itself (``RayActorError``: "The actor died unexpectedly ...")."""
    cause = getattr(err, "cause", None)
    shown = cause if isinstance(cause, BaseException) else err
    first = next((line.strip() for line in str(shown).splitlines() if line.strip()), "")
    return f"{type(shown).__name__}: {first}" if first else type(shown).__name__
