"""docs/api.md's lists that mirror a table in the code: the fields where null means the default
(``NULL_MEANS_DEFAULT``), OpenAI's fields lorafleet refuses unless null
(``UNSUPPORTED_OPENAI_FIELDS``), every request body's fields, the names chat_template_kwargs may
not set (``tokenizer.RENDER_VARIABLES``, the template's functions), and the error codes the server answers with (every ``code=``
literal in runtime/server and runtime/distributed, and ``errors.DEFAULT_CODES``). A field or
code added to the code fails here until the doc names it."""
from __future__ import annotations

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
UNUSED_DEFAULTS = {403, 429, 503}  # every 403, 429 and 503 names its own code (path_not_allowed, too_many_admin_requests, engine_unavailable, ...)


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


def test_every_error_code_is_in_the_table() -> None:
    rows = set(re.findall(r"^\| (\d{3}) \| `(\w+)` \| `(\w+)` \|", section("Errors"), re.MULTILINE))
    documented = {code for _, _, code in rows}
    sources = [*(ROOT / "runtime" / "server").glob("*.py"), *(ROOT / "runtime" / "distributed").glob("*.py")]
    emitted = {code for path in sources for code in re.findall(r'code="(\w+)"', path.read_text(encoding="utf-8"))}
    emitted |= {code for status, code in DEFAULT_CODES.items() if status not in UNUSED_DEFAULTS}
    assert sorted(emitted - NEVER_SENT - documented) == []
    assert [(s, t, c) for s, t, c in rows if ERROR_TYPES[int(s)] != t] == []  # each row's type is the one its status gets
