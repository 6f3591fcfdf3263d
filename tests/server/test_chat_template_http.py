"""The chat template over HTTP, on a copy of the tiny llama with a template of the test's own:
what the template raises while rendering a request's messages is a 400 naming the error (and
logged), never a 500, unless it is not a data error; vLLM's add_generation_prompt and
continue_final_message give transformers' prompts."""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import shutil
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from runtime.server.app import create_app
from runtime.server.options import ServerOptions
from tests.server.conftest import client_for, make_engine_config

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def served(tiny_llama_dir: Path, tmp_path: Path, template: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a server whose model is the tiny llama with ``template`` as its chat template."""
    from runtime.async_engine import AsyncLLMEngine

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    engine = AsyncLLMEngine(make_engine_config(model))
    try:
        async with client_for(create_app(engine, ServerOptions()), raise_app_exceptions=False) as c:
            c.model_name = engine.model_name  # type: ignore[attr-defined]
            yield c
    finally:
        engine.shutdown()


def chat_body(c: httpx.AsyncClient, messages: list[dict], **fields) -> dict:
    return {"model": c.model_name, "messages": messages, "max_tokens": 2, "temperature": 0, **fields}  # type: ignore[attr-defined]


# A template that works out the share of the turns that are the user's: it divides by their number.
PER_USER_TURN = ("{% set users = messages | selectattr('role', 'equalto', 'user') | list | length %}"
                 "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "[{{ (messages | length) // users }} turns per user turn]<|assistant|>")
# A reasoning template that keeps only what follows </think> of an earlier assistant turn.
ANSWER_ONLY = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}"
               "{{ m['content'][m['content'].index('</think>') + 8:] }}{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}<|assistant|>")


@pytest.mark.parametrize("template, messages, error", [
    (PER_USER_TURN, [{"role": "system", "content": "no user here"}], "ZeroDivisionError: integer division or modulo by zero"),
    (ANSWER_ONLY, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no think tag"}, {"role": "user", "content": "so?"}],
     "ValueError: substring not found"),
])
async def test_a_template_failing_on_the_request_values_is_a_400_naming_the_error(tiny_llama_dir, tmp_path, caplog, template, messages, error):
    """It was a 500 "internal server error" (ZeroDivisionError, TypeError, KeyError, ...) or, for a
    ValueError, a 400 that did not say the template had failed ("messages: substring not found")."""
    async with served(tiny_llama_dir, tmp_path, template) as c:
        usual = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<think>a</think>b"}, {"role": "user", "content": "y"}]
        fine = await c.post("/v1/chat/completions", json=chat_body(c, usual))
        assert fine.status_code == 200, fine.text
        with caplog.at_level(logging.WARNING, logger="lorafleet.server"):
            r = await c.post("/v1/chat/completions", json=chat_body(c, messages))
            tokenize = await c.post("/tokenize", json={"messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": f"messages: chat_template: failed on these inputs with {error}", "type": "invalid_request_error",
                                 "param": "messages", "code": "invalid_parameter"}
    assert tokenize.status_code == 400 and tokenize.json()["error"] == r.json()["error"]
    logged = [rec for rec in caplog.records if rec.name == "lorafleet.server" and error in rec.getMessage()]
    assert logged and all(rec.levelno == logging.WARNING and rec.exc_info for rec in logged)  # the traceback, for the operator


async def test_a_template_that_always_recurses_is_the_servers_500_and_a_startup_warning(tiny_llama_dir, tmp_path, caplog):
    """A template that recurses without end fails for every request: still the server's fault (a
    500), now known at load (calls nested past MAX_CALL_DEPTH rendering one short message), said
    once in a start-up warning, and each chat a 500 ``chat_template_unusable`` saying why; it was a
    RecursionError, a 500 "internal server error" and an ERROR traceback per request."""
    with caplog.at_level(logging.WARNING, logger="lorafleet.server"):
        async with served(tiny_llama_dir, tmp_path, "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}") as c:
            r = await c.post("/v1/chat/completions", json=chat_body(c, [{"role": "user", "content": "hi"}]))
    reason = "rendering one user message, calls nested more than 64 deep (a macro or a recursive loop calling itself), the limit"
    assert r.status_code == 500 and r.json()["error"]["code"] == "chat_template_unusable" and reason in r.json()["error"]["message"]
    logged = [rec for rec in caplog.records if rec.name == "lorafleet.server"]
    assert [rec.levelno for rec in logged] == [logging.WARNING] and reason in logged[0].getMessage()


async def test_calls_nested_too_deep_by_a_request_are_a_400_logged_without_a_traceback(tiny_llama_dir, tmp_path, caplog):
    """A macro recursing as deep as ``chat_template_kwargs`` says: past MAX_CALL_DEPTH a 400 naming
    the inputs and the limit, and a WARNING for the operator without a traceback (it was a
    RecursionError: a 500 and an ERROR traceback per request)."""
    template = "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(depth) }}{{ messages[0]['content'] }}"
    async with served(tiny_llama_dir, tmp_path, template) as c:
        messages = [{"role": "user", "content": "hi"}]
        fine = await c.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"depth": 3}})
        with caplog.at_level(logging.WARNING, logger="lorafleet.server"):
            r = await c.post("/v1/chat/completions", json=chat_body(c, messages, chat_template_kwargs={"depth": 5000}))
    assert fine.status_code == 200 and fine.json()["count"] == 2
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "messages, chat_template_kwargs: chat_template: calls nested more than 64 deep (a macro or a recursive "
                                            "loop calling itself), the limit; these messages or chat_template_kwargs ask the template for more "
                                            "than a prompt needs",
                                 "type": "invalid_request_error", "param": "messages, chat_template_kwargs", "code": "invalid_parameter"}
    logged = [rec for rec in caplog.records if rec.name == "lorafleet.server"]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING and not logged[0].exc_info


async def test_the_render_cap_follows_max_request_bytes(tiny_llama_dir, tmp_path, monkeypatch):
    """The cap on what a render builds was a fixed 16 Mi characters, whatever ``--max-request-bytes``
    said: a server taking larger bodies refused their prompts. It is now ``size_cap``: twice the
    body, never under MAX_RENDERED_CHARS (made 1000 here, so a small body shows it)."""
    import runtime.chat_template_sizes as sizes

    monkeypatch.setattr(sizes, "MAX_RENDERED_CHARS", 1000)
    async with served(tiny_llama_dir, tmp_path, "{% for m in messages %}{{ m['content'] ~ m['content'] }}{% endfor %}") as c:
        r = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "a " * 1500}]})  # 6000 characters: under 2 x 1 MiB
    assert r.status_code == 200 and r.json()["count"] == 6000, r.text  # "a" and " ", a token each


async def test_add_generation_prompt_and_continue_final_message_render_as_transformers(tiny_llama_dir, tmp_path):
    """vLLM's two chat fields (they were refused as unknown): add_generation_prompt false ends the prompt
    after the last message; continue_final_message ends it inside the last message, with no
    end-of-turn (</s> here), so the reply continues it: an assistant's, or a user's (which was a 400
    though vLLM and transformers continue it). Prompts as transformers renders them; usage,
    /tokenize and a stream agree with them."""
    from transformers import AutoTokenizer

    from runtime.tokenizer import Tokenizer
    from tests.fixtures.tiny_models import CHAT_TEMPLATE

    ref, ours = AutoTokenizer.from_pretrained(str(tiny_llama_dir)), Tokenizer(tiny_llama_dir)
    asked = [{"role": "user", "content": "name a colour"}]
    answered = [*asked, {"role": "assistant", "content": "Sure, the colour is"}]
    cases = [(asked, {}, dict(add_generation_prompt=True)),
             (asked, {"add_generation_prompt": False}, dict(add_generation_prompt=False)),
             (asked, {"add_generation_prompt": False, "continue_final_message": True}, dict(add_generation_prompt=False, continue_final_message=True)),
             (answered, {"add_generation_prompt": False, "continue_final_message": True}, dict(add_generation_prompt=False, continue_final_message=True))]
    async with served(tiny_llama_dir, tmp_path, CHAT_TEMPLATE) as c:
        for messages, fields, hf_fields in cases:
            want = ours.encode(ref.apply_chat_template(messages, tokenize=False, **hf_fields), add_special_tokens=False)
            r = await c.post("/v1/chat/completions", json=chat_body(c, messages, return_token_ids=True, **fields))
            assert r.status_code == 200, r.text
            choice, usage = r.json()["choices"][0], r.json()["usage"]
            assert choice["prompt_token_ids"] == want and usage["prompt_tokens"] == len(want), fields
            assert usage["completion_tokens"] == len(choice["token_ids"]) and choice["message"]["content"] == ours.decode(choice["token_ids"])
            counted = await c.post("/tokenize", json={"messages": messages, **fields})
            assert counted.status_code == 200 and counted.json()["tokens"] == want
            async with c.stream("POST", "/v1/chat/completions", json={**chat_body(c, messages, **fields), "stream": True,
                                                                      "stream_options": {"include_usage": True}}) as s:
                last = [line async for line in s.aiter_lines() if line.startswith("data: {")][-1]
            assert json.loads(last[len("data: "):])["usage"] == usage
            if messages is asked and fields.get("continue_final_message"):
                assert ours.decode(want).endswith("<|user|>name a colour"), want  # the user's message, left open
        assert want[-1] != ours.eos_token_ids[0] and ours.decode(want).endswith("Sure, the colour is")


# The ways a template can take a message's content: left out, null, empty, or text.
CONTENT_AWARE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.content is not defined %}(left out){% elif m.content is none %}(null)"
                 "{% elif m.content %}{{ m.content }}{% else %}(empty){% endif %}</s>{% endfor %}<|assistant|>")


async def test_null_content_reaches_the_template_as_transformers_passes_it(tiny_llama_dir, tmp_path):
    """An assistant message with ``"content": null`` (allowed by the OpenAI API: a turn with no
    text) reached the template as ``""``; transformers' apply_chat_template leaves a null key out,
    and templates tell the two apart (``message.content is defined``). The prompt is now transformers'."""
    from transformers import AutoTokenizer

    from runtime.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "assistant", "content": ""},
                {"role": "user", "content": "so?"}]
    async with served(tiny_llama_dir, tmp_path, CONTENT_AWARE) as c:
        model = tmp_path / "model"
        text = AutoTokenizer.from_pretrained(str(model)).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert "<|assistant|>(left out)</s><|assistant|>(empty)</s>" in text
        want = Tokenizer(model).encode(text, add_special_tokens=False)
        counted = await c.post("/tokenize", json={"messages": messages})
        r = await c.post("/v1/chat/completions", json=chat_body(c, messages, return_token_ids=True))
    assert counted.status_code == 200 and counted.json()["tokens"] == want, counted.text
    assert r.status_code == 200 and r.json()["choices"][0]["prompt_token_ids"] == want, r.text

FIELD_REFUSALS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "continue_final_message": True},
     "continue_final_message: not with add_generation_prompt: true (the default), which starts a new message; send add_generation_prompt: false"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
     "continue_final_message: not with add_generation_prompt: true (the default), which starts a new message; send add_generation_prompt: false"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt: only with messages (it is how the chat template renders them)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": 0}, "add_generation_prompt: Input should be a valid boolean"),
]


async def test_chat_template_field_refusals(tiny_llama_dir, tmp_path):
    async with served(tiny_llama_dir, tmp_path, "{% for m in messages %}{{ m['content'] }}{% endfor %}") as c:
        for route, body, message in FIELD_REFUSALS:
            r = await c.post(route, json={"model": c.model_name, **body})  # type: ignore[attr-defined]
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == message and r.json()["error"]["param"] == message.split(":")[0]


async def test_continue_final_message_with_a_template_that_writes_messages_whole_is_a_400(tiny_llama_dir, tmp_path):
    """A template that never names ``content`` (``m | tojson``) cannot be continued, as transformers
    refuses it; lorafleet cut the JSON string open after the last message's text."""
    async with served(tiny_llama_dir, tmp_path, "{% for m in messages %}{{ m | tojson }}{% endfor %}") as c:
        body = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                "add_generation_prompt": False, "continue_final_message": True}
        for route in ("/v1/chat/completions", "/tokenize"):
            r = await c.post(route, json={"model": c.model_name, **body})  # type: ignore[attr-defined]
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "continue_final_message" and "never names 'content'" in error["message"], error


async def test_tokenize_a_prompt_with_chat_template_fields_at_their_defaults(tiny_llama_dir, tmp_path):
    """A /tokenize prompt beside chat template fields that ask for nothing (null kwargs, as clients send
    an unset field, or {}; the defaults) encodes the prompt; they were a 400 'only with messages'."""
    async with served(tiny_llama_dir, tmp_path, "{% for m in messages %}{{ m['content'] }}{% endfor %}") as c:
        plain = await c.post("/tokenize", json={"prompt": "a b"})
        for fields in ({"chat_template_kwargs": None}, {"chat_template_kwargs": {}}, {"add_generation_prompt": True, "continue_final_message": False}):
            r = await c.post("/tokenize", json={"prompt": "a b", **fields})
            assert r.status_code == 200, (fields, r.text)
            assert r.json()["tokens"] == plain.json()["tokens"]


THINKING = ("{{ bos_token }}{% if enable_thinking is defined and not enable_thinking %}<|nothink|>{% endif %}"
            "{% if budget is defined and budget > 100 %}<|long|>{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}<|assistant|>")


async def test_chat_template_kwargs_reach_the_template(tiny_llama_dir, tmp_path, caplog):
    """vLLM's chat_template_kwargs (refused as an unknown field before): its keys are template variables,
    for chat completions and /tokenize alike; null is not set."""
    from runtime.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "hi"}]
    async with served(tiny_llama_dir, tmp_path, THINKING) as c:
        ids = {}
        for kwargs in (None, {"enable_thinking": False, "budget": 500}):
            r = await c.post("/v1/chat/completions", json=chat_body(c, messages, return_token_ids=True, chat_template_kwargs=kwargs))
            assert r.status_code == 200, r.text
            ids[bool(kwargs)] = r.json()["choices"][0]["prompt_token_ids"]
            counted = await c.post("/tokenize", json={"messages": messages, "chat_template_kwargs": kwargs})
            assert counted.json()["tokens"] == ids[bool(kwargs)]
        with caplog.at_level(logging.WARNING, logger="lorafleet.server"):
            wrong_type = await c.post("/v1/chat/completions", json=chat_body(c, messages, chat_template_kwargs={"budget": "high"}))
    tok = Tokenizer(tmp_path / "model")
    assert tok.decode(ids[False], skip_special_tokens=False) == "<s><|user|>hi</s><|assistant|>"
    assert tok.decode(ids[True], skip_special_tokens=False) == "<s><|nothink|><|long|><|user|>hi</s><|assistant|>"
    assert wrong_type.status_code == 400, wrong_type.text  # the template compares it with a number: the request's fault, not a 500
    # kwargs drove it: the error names both inputs (it named messages alone), as which one cannot be told
    assert wrong_type.json()["error"]["message"] == ("messages, chat_template_kwargs: chat_template: failed on these inputs with TypeError: "
                                                     "'>' not supported between instances of 'str' and 'int'")
    assert wrong_type.json()["error"]["param"] == "messages, chat_template_kwargs"


KWARGS_REFUSALS = [
    ({"enable_thinking": True, "messages": []}, "chat_template_kwargs: 'messages' cannot be set: lorafleet sets it to the request's messages"),
    ({"add_generation_prompt": False}, "chat_template_kwargs: 'add_generation_prompt' cannot be set: lorafleet sets it to the request's add_generation_prompt field"),
    ({"tools": [{"type": "function"}]}, "chat_template_kwargs: 'tools' cannot be set: lorafleet sets it to none (lorafleet has no tool calling)"),
    ({"raise_exception": "no"}, "chat_template_kwargs: 'raise_exception' cannot be set: lorafleet sets it to a function templates call"),
    # jinja's render takes self itself: it was a 400 on messages, "the template failed with TypeError", logged with a traceback
    ({"self": 1}, "chat_template_kwargs: 'self' cannot be set: lorafleet sets it to jinja's reference to the template (the render's own argument)"),
    ({"note": "\ud800"}, "chat_template_kwargs: not valid Unicode text: a lone surrogate '\\ud800' at character 0"),
    ({"nested": {"x": ["\ud800"]}}, "chat_template_kwargs: not valid Unicode text: a lone surrogate '\\ud800' at character 0"),
    ("enable_thinking", "chat_template_kwargs: Input should be a valid dictionary"),
]


async def test_chat_template_kwargs_refusals(tiny_llama_dir, tmp_path):
    """A key the server sets itself (but a special token's, which overrides it as in transformers) is refused by name,
    never overridden; strings must be Unicode text."""
    async with served(tiny_llama_dir, tmp_path, THINKING) as c:
        for (kwargs, message), route in itertools.product(KWARGS_REFUSALS, ("/v1/chat/completions", "/tokenize")):
            body = {"model": c.model_name, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}  # type: ignore[attr-defined]
            r = await c.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": "chat_template_kwargs", "code": "invalid_parameter"}


async def test_a_template_asked_to_build_too_much_is_a_400(tiny_llama_dir, tmp_path):
    """``'-' * width`` with a client's width past MAX_TEMPLATE_REPETITION was built whatever its size
    (here a MemoryError: a 500); it is a 400 on messages naming the limit, on both routes."""
    from runtime.tokenizer import MAX_TEMPLATE_REPETITION

    async with served(tiny_llama_dir, tmp_path, "{{ '-' * width }}{% for m in messages %}{{ m['content'] }}{% endfor %}") as c:
        messages = [{"role": "user", "content": "hi"}]
        fine = await c.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"width": 3}})
        for route, body in (("/v1/chat/completions", chat_body(c, messages)), ("/tokenize", {"messages": messages})):
            r = await c.post(route, json={**body, "chat_template_kwargs": {"width": 2**62}})
            assert r.status_code == 400, r.text
            assert r.json()["error"] == {"message": f"messages, chat_template_kwargs: chat_template: '*' would build a str of {2**62} characters (1 x {2**62}), past the limit "
                                                    f"of {MAX_TEMPLATE_REPETITION} characters; these messages or chat_template_kwargs ask the "
                                                    "template for more than a prompt needs",
                                         "type": "invalid_request_error", "param": "messages, chat_template_kwargs", "code": "invalid_parameter"}
    assert fine.status_code == 200 and fine.json()["count"] == 5  # "---hi", a byte each


async def test_a_template_asked_for_too_many_steps_is_a_400(tiny_llama_dir, tmp_path):
    """Nested ``range(n)`` loops that write nothing, with a client's n: the size limits never fired
    and the render ran n**2 loop items (for n = 100000, hours of a thread); past MAX_TEMPLATE_STEPS
    it is a 400 on messages naming the limit, on both routes."""
    import math

    from runtime.chat_template_budget import MAX_TEMPLATE_STEPS

    template = "{% for i in range(n) %}{% for j in range(n) %}{% endfor %}{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    async with served(tiny_llama_dir, tmp_path, template) as c:
        messages = [{"role": "user", "content": "hi"}]
        fine = await c.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"n": 30}})
        for route, body in (("/v1/chat/completions", chat_body(c, messages)), ("/tokenize", {"messages": messages})):
            r = await c.post(route, json={**body, "chat_template_kwargs": {"n": math.isqrt(MAX_TEMPLATE_STEPS) + 1}})
            assert r.status_code == 400, r.text
            assert r.json()["error"] == {"message": f"messages, chat_template_kwargs: chat_template: the render took more than {MAX_TEMPLATE_STEPS} steps (loop items, "
                                                    "range items and calls), the limit; these messages or chat_template_kwargs ask the "
                                                    "template for more work than a prompt needs",
                                         "type": "invalid_request_error", "param": "messages, chat_template_kwargs", "code": "invalid_parameter"}
    assert fine.status_code == 200 and fine.json()["count"] == 2


BROKEN_TEMPLATE = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"  # line 2 closes {{ with a single }


async def test_a_chat_template_that_does_not_compile_is_the_servers_500_and_a_startup_warning(tiny_llama_dir, tmp_path, caplog):
    """A jinja syntax error in the checkpoint's template was a 400 on messages for every chat request,
    as if each client had sent bad messages. The server starts (completions and /tokenize of a prompt
    work: a completion-only model may ship a broken template it never uses), says so in a warning
    naming the template's source and jinja's line, and chat is a 500 that says the server's template
    is at fault."""
    with caplog.at_level(logging.WARNING, logger="lorafleet.server"):
        async with served(tiny_llama_dir, tmp_path, BROKEN_TEMPLATE) as c:
            started = [rec.getMessage() for rec in caplog.records if rec.name == "lorafleet.server"]
            messages = [{"role": "user", "content": "hi"}]
            chat = await c.post("/v1/chat/completions", json=chat_body(c, messages))
            counted = await c.post("/tokenize", json={"messages": messages})
            completion = await c.post("/v1/completions", json={"model": c.model_name, "prompt": "hi", "max_tokens": 2})  # type: ignore[attr-defined]
            prompt = await c.post("/tokenize", json={"prompt": "hi"})
    assert any(f"{tmp_path / 'model' / 'tokenizer_config.json'} (chat_template): does not compile: line 2: unexpected '}}'" in m
               for m in started), started
    assert chat.status_code == 500, chat.text
    assert chat.json()["error"] == {"message": "the server's chat template cannot be used (does not compile: line 2: unexpected '}'); "
                                               "chat fails until the server's operator fixes it (completions work)",
                                    "type": "internal_server_error", "param": None, "code": "chat_template_unusable"}
    assert counted.status_code == 500 and counted.json() == chat.json()
    assert completion.status_code == 200 and prompt.status_code == 200
