"""docs/api.md's lists that mirror a table in the code: the fields where null means the default
(``NULL_MEANS_DEFAULT``), OpenAI's fields lorafleet refuses unless null
(``UNSUPPORTED_OPENAI_FIELDS``), every request body's fields, the names chat_template_kwargs may
not set (``tokenizer.RENDER_VARIABLES``, the template's functions), and the error codes the server answers with (every code
literal in runtime/server and runtime/distributed, ``errors.DEFAULT_CODES``, and the default code of
every status an error there is made with without a code). A field or code added to the code fails
here until the doc names it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from jinja2.defaults import DEFAULT_NAMESPACE

from runtime.server import protocol
from runtime.server.errors import DEFAULT_CODES, ERROR_TYPES
from runtime.server.protocol import NULL_MEANS_DEFAULT, UNSUPPORTED_OPENAI_FIELDS
from runtime.tokenizer import RENDER_VARIABLES, TEMPLATE_FUNCTIONS

ROOT = Path(__file__).resolve().parents[2]
API_DOC = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
NEVER_SENT = {"client_closed_request"}  # 499: the client is gone, nobody reads it
UNUSED_DEFAULTS = {403, 429, 503}  # today every 403, 429 and 503 names its own code: their defaults are required once one is made without
# The calls that make an error response: name -> (index of the status argument, index of the code argument, or None where it takes none).
ERROR_MAKERS = {"APIError": (0, 3), "error_body": (0, 3), "error_response": (0, 3), "_reply": (1, None),
                "HTTPException": (0, None), "StarletteHTTPException": (0, None)}


def section(title: str) -> str:
    """The text of the ``## title`` section."""
    start = API_DOC.index(f"\n## {title}\n")
    end = API_DOC.find("\n## ", start + 1)
    return API_DOC[start:end if end != -1 else None]


def test_null_means_default_lists_every_field() -> None:
    listed = set(re.findall(r"`(\w+)`", section("null means the default").split("The fields:", 1)[1]))
    assert listed == set(NULL_MEANS_DEFAULT)


def test_unsupported_openai_fields_are_all_named() -> None:
    text = section("Strict numbers, unknown fields")
    assert [name for name in UNSUPPORTED_OPENAI_FIELDS if f"`{name}`" not in text] == []


def test_every_request_field_is_named() -> None:
    """Each field of the request bodies is named in the doc, as `field`."""
    models = [protocol.CompletionRequest, protocol.ChatCompletionRequest, protocol.ChatMessage, protocol.StreamOptions,
              protocol.TokenizeRequest, protocol.DetokenizeRequest, protocol.LoadAdapterRequest, protocol.UnloadAdapterRequest]
    assert [(m.__name__, f) for m in models for f in m.model_fields if f"`{f}`" not in API_DOC and f".{f}`" not in API_DOC] == []


def test_reserved_template_variables_are_listed() -> None:
    """chat_template_kwargs' row names every key the server refuses there."""
    row = next(line for line in section("Chat completions: `POST /v1/chat/completions`").splitlines() if line.startswith("| `chat_template_kwargs`"))
    reserved = {*RENDER_VARIABLES, *TEMPLATE_FUNCTIONS, *DEFAULT_NAMESPACE}
    assert sorted(name for name in reserved if f"`{name}`" not in row) == []


def error_calls(source: str) -> list[tuple[object, object]]:
    """``(status, code)`` of every ``ERROR_MAKERS`` call in ``source``: each an int or str literal,
    None for a code not given (or given as None: the status's default code then applies), or the
    ``ast`` node of an expression (a status or code passed on from another error)."""
    found = []
    for node in sorted((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset)):
        name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr if isinstance(node.func, ast.Attribute) else None
        if name not in ERROR_MAKERS:
            continue
        status_at, code_at = ERROR_MAKERS[name]
        keywords = {k.arg: k.value for k in node.keywords}
        status = node.args[status_at] if len(node.args) > status_at else keywords.get("status", keywords.get("status_code"))
        code = None if code_at is None else node.args[code_at] if len(node.args) > code_at else keywords.get("code")
        literal = lambda n: n.value if isinstance(n, ast.Constant) else n  # noqa: E731
        found.append((literal(status), None if code is None else literal(code)))
    return found


def test_error_calls_finds_the_statuses_made_without_a_code() -> None:
    """The guard's parser: a 503 (or 403, 429) made without a code, in any of the forms below, is found."""
    source = """
raise APIError(503, "a")
raise APIError(403, "b", "param", None)
raise APIError(status=429, message="c")
error_response(503, "d", param="x")
error_body(429, "e")
await _reply(send, 403, "f")
raise HTTPException(status_code=503)
raise APIError(503, "g", code="engine_unavailable")
raise APIError(503, "h", None, "replica_unavailable")
raise APIError(err.status, err.message, err.param, err.code)
"""
    calls = error_calls(source)
    assert [status for status, code in calls if code is None] == [503, 403, 429, 503, 429, 403, 503]
    assert [code for _, code in calls[7:9]] == ["engine_unavailable", "replica_unavailable"]
    assert all(isinstance(part, ast.AST) for part in calls[9])


def test_every_error_code_is_in_the_table() -> None:
    """Every code the server can answer with: each literal one, each status's default code (those
    of 403, 429 and 503 where an error with that status is made without a code), is documented."""
    rows = set(re.findall(r"^\| (\d{3}) \| `(\w+)` \| `(\w+)` \|", section("Errors"), re.MULTILINE))
    documented = {code for _, _, code in rows}
    sources = [*(ROOT / "runtime" / "server").glob("*.py"), *(ROOT / "runtime" / "distributed").glob("*.py")]
    emitted = {code for path in sources for code in re.findall(r'code="(\w+)"', path.read_text(encoding="utf-8"))}
    calls = [call for path in sources for call in error_calls(path.read_text(encoding="utf-8"))]
    emitted |= {code for _, code in calls if isinstance(code, str)}
    emitted |= {code for status, code in DEFAULT_CODES.items() if status not in UNUSED_DEFAULTS}
    emitted |= {DEFAULT_CODES[status] for status, code in calls if code is None and isinstance(status, int)}
    assert sorted(emitted - NEVER_SENT - documented) == []
    assert [(s, t, c) for s, t, c in rows if ERROR_TYPES[int(s)] != t] == []  # each row's type is the one its status gets
