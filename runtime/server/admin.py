"""Adapter admin: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Only mounted with ``--enable-adapter-admin``; without it, ``build_disabled_router`` answers both
with a 404 that says so. A path must resolve, symlinks
included, inside one of the ``--adapter-root`` folders before anything is read, and so
must the files the loader opens in it; the loader checks again, on the paths it then opens
with no symlink followed, so a symlink swapped in after the first check is refused too.
Loading an existing name is a hot update: a new immutable version; requests in
flight finish on the version they started with. Once the engine has died or is shut
down, both routes answer 503 ``engine_unavailable``, as the generation routes do.
Their blocking work runs on threads of their own (``AdminWorkers``), never on the event loop's
default executor, which /metrics and long prompts need; past ``ADMIN_MAX_IN_PROGRESS`` calls
in progress, one more is a 429 ``too_many_admin_requests``.
"""
from __future__ import annotations

import functools
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from runtime.async_engine import EngineDeadError
from runtime.request import UnknownAdapterError
from runtime.server.admin_workers import AdminBusy
from runtime.server.errors import APIError, UTF8Route
from runtime.server.protocol import LoadAdapterRequest, UnloadAdapterRequest
from runtime.lora.adapter import CONFIG_FILE, PICKLE_FILES, WEIGHTS_FILE, AdapterPathError
from runtime.server.security import confine_adapter_folder


def build_router(state: Any) -> APIRouter:
    router = APIRouter(route_class=UTF8Route)
    workers = state.admin_workers  # the app's: they end with its lifespan

    async def off_loop(fn: Any, *args: Any) -> Any:
        try:
            return await workers.run(fn, *args)
        except AdminBusy as err:
            raise APIError(429, str(err), code="too_many_admin_requests") from err

    @router.post("/v1/load_lora_adapter", tags=["admin"])
    async def load_lora_adapter(body: LoadAdapterRequest) -> Any:
        if body.lora_name == state.base_name:
            raise APIError(400, f"lora_name {body.lora_name!r} is the base model's name", param="lora_name", code="invalid_parameter")
        try:
            path = confine_adapter_folder(body.lora_path, state.options.adapter_roots, (CONFIG_FILE, WEIGHTS_FILE, *PICKLE_FILES))
        except PermissionError as err:
            raise APIError(403, str(err), param="lora_path", code="path_not_allowed") from err
        except ValueError as err:
            raise APIError(400, str(err), param="lora_path", code="invalid_parameter") from err
        try:  # the loader confines again the paths it opens, so a symlink swapped in since this check is refused (docs/security.md)
            ref = await off_loop(functools.partial(state.engine.register_adapter, body.lora_name, str(path), within=state.options.adapter_roots))
        except EngineDeadError as err:  # a RuntimeError: the engine died or is shut down
            raise APIError(503, str(err), code="engine_unavailable") from err
        except AdapterPathError as err:  # resolved outside the roots by the time it was opened: what the check above refuses
            raise APIError(403, str(err), param="lora_path", code="path_not_allowed") from err
        except ValueError as err:  # the validator's message: names the file and the key/tensor
            raise APIError(400, str(err), param="lora_path", code="invalid_adapter") from err
        except OSError as err:  # unreadable, or removed between the loader's checks and its read
            what = err.filename or "the adapter files"
            raise APIError(400, f"lora_path {body.lora_path!r}: cannot read {what}: {err.strerror or err}", param="lora_path", code="invalid_adapter") from err
        return JSONResponse({"object": "lora_adapter", "lora_name": ref.name, "version": ref.version, "lora_path": str(path)})

    @router.post("/v1/unload_lora_adapter", tags=["admin"])
    async def unload_lora_adapter(body: UnloadAdapterRequest) -> Any:
        try:
            await off_loop(state.engine.unregister_adapter, body.lora_name)
        except EngineDeadError as err:
            raise APIError(503, str(err), code="engine_unavailable") from err
        except UnknownAdapterError as err:
            raise APIError(404, str(err), param="lora_name", code="model_not_found") from err
        return JSONResponse({"object": "lora_adapter", "lora_name": body.lora_name, "unloaded": True})

    return router


ADMIN_OFF_MESSAGE = ("{path}: adapter admin is off on this server; start `lorafleet serve` with --enable-adapter-admin "
                     "(and --adapter-root DIR, the folder adapters may be loaded from) to add and remove adapters at run time")


def build_disabled_router() -> APIRouter:
    """Without ``--enable-adapter-admin`` the admin routes do nothing but say how to turn them on:
    a 404 ``not_found`` as for any route that is not there, with a message instead of "Not Found".
    Left out of the schema."""
    router = APIRouter(route_class=UTF8Route)

    def refuse(path: str) -> Any:
        async def admin_off() -> Any:
            raise APIError(404, ADMIN_OFF_MESSAGE.format(path=path), code="not_found")

        return admin_off

    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        router.add_api_route(path, refuse(path), methods=["POST"], include_in_schema=False)
    return router
