"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Coroutine, Sequence

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.server.protocol import UNSUPPORTED_OPENAI_FIELDS

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
# ``error.code`` when a handler names none: always a string, as in OpenAI's errors (clients
# that type it as a string fail to parse a number).
DEFAULT_CODES = {
    400: "invalid_parameter",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    499: "client_closed_request",
    500: "internal_error",
    503: "service_unavailable",
}
log = logging.getLogger("lorafleet.server")


class APIError(Exception):
    """Raised by route handlers; rendered as an OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    code = code or DEFAULT_CODES.get(status, "error")
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error"), "param": param, "code": code}}


def internal_error_body(err: BaseException) -> dict:
    """The 500 for an unexpected exception (logged by the caller): its type, never its text."""
    return error_body(500, f"internal server error ({type(err).__name__}); the server log has the details", code="internal_error")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def _is_union_tag(part: object) -> bool:
    """pydantic names the branch of a union in an error's loc (``prompt.list[int].1``,
    ``stop.function-after[_valid_unicode(), str]``): every union of the request models has
    branches whose names hold brackets, and field names never do."""
    return isinstance(part, str) and "[" in part


def _most_telling(errors: Sequence[dict]) -> dict:
    """The error to report when pydantic gives several (one per branch of a union): one our
    validators raised (it says what is wrong), else the one deepest in the body (the branch
    that got furthest, e.g. ``prompt.1`` of a list of strings), else the first."""
    if not errors:
        return {}
    depth = lambda e: len([p for p in e.get("loc", ()) if not _is_union_tag(p)])  # noqa: E731
    return max(errors, key=lambda e: (e.get("type") == "value_error", depth(e)))


# pydantic's length errors -> (bound, limit's ctx key): worded here with the unit the value has.
_LENGTH_ERRORS = {"too_long": ("at most", "max_length"), "string_too_long": ("at most", "max_length"),
                  "too_short": ("at least", "min_length"), "string_too_short": ("at least", "min_length")}


def _length_words(error: dict) -> str:
    """A length limit in plain words, counted in what the value holds: ``at most 256 characters,
    got 257`` (pydantic says "items after validation" even for a string)."""
    bound, key = _LENGTH_ERRORS[error["type"]]
    ctx, value = error.get("ctx") or {}, error.get("input")
    limit = ctx.get(key)
    unit = "character" if isinstance(value, str) else "entry" if isinstance(value, dict) else "item"
    units = unit if limit == 1 else {"entry": "entries"}.get(unit, unit + "s")
    actual = ctx.get("actual_length", len(value) if isinstance(value, (str, list, dict)) else None)
    return f"{bound} {limit} {units}" + (f", got {actual}" if actual is not None else "")


def _plain_words(error: dict) -> str:
    """What a pydantic error says, in the API's words: our validators' own text (without
    pydantic's ``Value error, `` prefix), length limits in characters, items or entries, a field
    the model does not have as unknown or, for one of OpenAI's, as not supported (naming what
    lorafleet lacks), and pydantic's message for the rest."""
    kind, ctx = error.get("type"), error.get("ctx") or {}
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return str(ctx["error"])
    if kind == "extra_forbidden":  # pydantic: "Extra inputs are not permitted"
        feature = UNSUPPORTED_OPENAI_FIELDS.get(str(error.get("loc", ("",))[-1]))
        return f"not supported: lorafleet does not implement {feature} (null is accepted)" if feature else "unknown field"
    if kind in _LENGTH_ERRORS and (ctx.get("max_length") is not None or ctx.get("min_length") is not None):
        return _length_words(error)
    return str(error.get("msg", "invalid value"))


def _field_message(param: str, text: str) -> str:
    """``param: text``, the form of every message about a field; once only, where ``text``
    already starts so."""
    return text if text.startswith(f"{param}:") else f"{param}: {text}"


def _not_utf8_message(err: UnicodeDecodeError) -> str:
    """The message for a request body that is not UTF-8, naming the first bad byte."""
    return f"the request body is not valid UTF-8 (byte 0x{err.object[err.start]:02x} at position {err.start})"


class UTF8Request(Request):
    """A request whose JSON body is read as UTF-8, as JSON sent over a network must be (RFC 8259;
    a leading byte-order mark is allowed). Starlette's ``json()`` lets ``json.loads`` guess UTF-16
    or UTF-32 from the first bytes, so such a body got a misleading JSON error instead."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = json.loads((await self.body()).decode("utf-8-sig"))
        return self._json


class UTF8Route(APIRoute):
    """An APIRoute that hands FastAPI a ``UTF8Request``: the routers' ``route_class``. A body
    that is not UTF-8 then fails with a UnicodeDecodeError, which FastAPI answers with a 400
    that ``install_error_handlers`` words with ``_not_utf8_message``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def utf8_handler(request: Request) -> Response:
            return await handler(UTF8Request(request.scope, request.receive))

        return utf8_handler


def _routing_message(request: Request, err: StarletteHTTPException) -> str:
    """The message of an HTTP error Starlette raised: for its router's 404 and 405, whose detail is
    only the status phrase ("Not Found"), what was asked and what the server has; else the detail."""
    asked = f"{request.method} {request.url.path}"
    if err.status_code == 404 and err.detail == "Not Found":
        return f"no route {asked}; GET /openapi.json lists the routes"
    if err.status_code == 405 and err.detail == "Method Not Allowed":
        allowed = (err.headers or {}).get("Allow") or (err.headers or {}).get("allow")
        return f"{asked}: method not allowed" + (f"; this route takes {allowed}" if allowed else "")
    return str(err.detail)


def install_error_handlers(app: FastAPI) -> None:
    """Every error a route can end in is answered in the OpenAI shape, never as plain text."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        first = _most_telling(err.errors())
        if first.get("type") == "json_invalid":  # its loc is the byte offset, not a field
            where = first.get("loc", ("body", "?"))[-1]
            detail = (first.get("ctx") or {}).get("error", "invalid JSON")
            return error_response(400, f"the request body is not valid JSON (at position {where}: {detail})", code="invalid_json")
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p)]
        if not loc and first.get("type") in ("missing", "model_attributes_type", "dict_type"):  # no body, or not a JSON object
            return error_response(400, "the request body must be a JSON object, sent with Content-Type: application/json", code="invalid_json")
        param = ".".join(loc) or None
        message = _field_message(param, _plain_words(first)) if param else _plain_words(first)
        return error_response(400, message, param=param, code="invalid_parameter")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 400:  # FastAPI could not parse the body at all (e.g. it is not UTF-8: UTF8Route)
            cause = err.__cause__
            message = _not_utf8_message(cause) if isinstance(cause, UnicodeDecodeError) else f"the request body is not valid JSON: {err.detail}"
            return error_response(400, message, code="invalid_json")
        response = error_response(err.status_code, _routing_message(request, err))
        response.headers.update(err.headers or {})  # e.g. the Allow header Starlette's router sets on a 405
        return response

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, err: Exception) -> JSONResponse:
        """Anything no handler above claims (a bug): logged with its traceback, answered as a 500.

        Starlette re-raises the exception after sending this response, so the HTTP server
        (uvicorn) logs it as well.
        """
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(err).__name__, err, exc_info=err)
        return JSONResponse(internal_error_body(err), status_code=500)


ERROR_SCHEMA = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}},
}


def install_openapi_errors(app: FastAPI) -> None:
    """/openapi.json as the server answers: a request that fails validation gets a 400 in
    OpenAI's error shape (``ErrorResponse``), not FastAPI's default 422 ``HTTPValidationError``."""

    def schema() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for operations in spec.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = {"description": "Invalid request: the error names the field in `param`",
                                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            schemas["ErrorResponse"] = ERROR_SCHEMA
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]
