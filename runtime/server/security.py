"""Request guards: API key (constant-time), body size limit, adapter path confinement."""
from __future__ import annotations

import hmac
import json
import os
from pathlib import Path
from typing import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.server.errors import error_body

OPEN_PATHS = frozenset({"/health"})


class GuardMiddleware:
    """Pure ASGI middleware: rejects requests without the API key, and bodies over the limit.

    The body limit is enforced on the bytes actually received, not only on the
    Content-Length header, so a chunked upload cannot slip past it.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _reply(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
                return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _reply(send, 413, f"request body of {int(declared)} bytes exceeds the limit of {self.max_bytes}")
            return
        received = 0
        responded = False
        rejected = False

        async def limited_receive() -> Message:
            # Over the limit: answer 413 here and tell the app the client is gone. Raising
            # instead would not work: FastAPI turns any error while reading the body into a 400.
            nonlocal received, responded, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    rejected = True
                    if not responded:
                        responded = True
                        await _reply(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes")
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal responded
            if rejected:
                return  # the 413 already answered; whatever the app says after it is dropped
            if message["type"] == "http.response.start":
                responded = True
            await send(message)

        await self.app(scope, limited_receive, tracking_send)


async def _reply(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def confine_path(raw: str, roots: Iterable[Path]) -> Path:
    """Resolve ``raw`` (symlinks included) and return it if it lies inside one of ``roots``.

    Raises PermissionError otherwise, and ValueError for a string that is no usable path (a
    NUL byte; inside a root, a symlink loop). Nothing inside the path is read: only the path
    components are resolved. Whether the path lies in a root is settled first, without an error
    from the file system, so a path outside gets the same 403 whatever is there (a 400 "Not a
    directory" for /etc/shadow/x, against a 403 for a path that is not a file, told a caller what
    exists outside the roots).
    """
    roots = [Path(r).resolve() for r in roots]
    if not roots:
        raise PermissionError("adapter loading by path is disabled: start the server with --adapter-root DIR")
    candidate = Path(raw)
    if not candidate.is_absolute():
        raise PermissionError(f"lora_path must be absolute, got {raw!r}")
    try:
        resolved = Path(os.path.realpath(candidate))  # not strict: a missing file or a symlink loop raises nothing here
    except ValueError as err:  # a NUL byte, a lone surrogate
        raise ValueError(f"lora_path {raw!r} is not a usable path: {err}") from None
    if not any(resolved == root or root in resolved.parents for root in roots):
        raise PermissionError(f"lora_path {raw!r} resolves outside every --adapter-root")
    try:
        os.stat(resolved)  # inside a root: a symlink loop, which realpath leaves in place, is ELOOP here
    except FileNotFoundError:
        pass  # a missing file is the loader's to report
    except OSError as err:
        raise ValueError(f"lora_path {raw!r} is not a usable path: {err}") from None
    return resolved


def confine_adapter_folder(raw: str, roots: Iterable[Path], file_names: Iterable[str]) -> Path:
    """``confine_path`` for an adapter folder, and for the files the loader will open in it.

    A folder inside the root can hold a symlink such as ``adapter_model.safetensors ->
    /etc/secret``: confining the folder alone would let the loader read (and its error
    messages quote parts of) a file outside the root. Files that do not exist yet pass
    here; the loader reports them missing, and a path that is a file, not a folder.
    """
    folder = confine_path(raw, roots)
    if folder.exists() and not folder.is_dir():
        return folder  # no files inside a file: the loader names it ("is a file; give the adapter folder ...")
    for name in file_names:
        try:
            confine_path(str(folder / name), roots)
        except PermissionError as err:
            raise PermissionError(f"lora_path {raw!r}: {name} resolves outside every --adapter-root") from err
    return folder
