"""What a chat template may build besides ``*`` and the prompt (runtime/chat_template_sizes.py), and
how deep its calls may nest (chat_template_budget.MAX_CALL_DEPTH): each is refused before it is
built, with ChatTemplateTooLarge naming the limit; below the limits renders are transformers'."""
from __future__ import annotations

import re

import pytest

from tests.test_chat_template_parity import FixedNow, _render_both, with_template  # noqa: F401 (a fixture)

HUGE = 10**10
MESSAGES = [{"role": "user", "content": "hi"}]
DOUBLING = "{% set ns = namespace(s='ab') %}{% for i in range(n) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}{{ ns.s | length }}"
SHARED = "{% set s = 'x' * 1048576 %}"  # one string of 1 Mi characters; [s] * n holds n references to it, not n copies

# template, kwargs that stay small (rendered as transformers does), kwargs that ask for too much; what is named
GROWTHS = [
    (DOUBLING.replace("OP", "~"), {"n": 10}, {"n": 40}, "'~'"),
    (DOUBLING.replace("OP", "+"), {"n": 10}, {"n": 40}, "'+'"),
    ("{{ 'x' | center(n) }}", {"n": 9}, {"n": HUGE}, "the center filter"),
    ("{{ '%*s' | format(n, 'x') }}", {"n": 9}, {"n": HUGE}, "the format filter"),
    ("{{ '%*s' % (n, 'x') }}", {"n": 9}, {"n": HUGE}, "'%'"),
    ("{{ '{:>{w}}'.format('x', w=n) }}", {"n": 9}, {"n": HUGE}, "str.format"),
    ("{{ 'x'.ljust(n) ~ '|' }}", {"n": 9}, {"n": HUGE}, "str.ljust"),
    ("{{ 'a\\nb' | indent(n) }}", {"n": 3}, {"n": HUGE}, "the indent filter"),
    ("{{ [1, 2] | tojson(indent=n) }}", {"n": 2}, {"n": HUGE}, "the tojson filter"),
    ("{{ [1, 2, 3] | batch(n, 0) | list }}", {"n": 2}, {"n": HUGE}, "the batch filter"),
    (SHARED + "{{ ([s] * n) | join | length }}", {"n": 2}, {"n": 1000}, "the join filter"),
    (SHARED + "{{ ([s] * n) | length }}{% if n > 999 %}{{ [s] * n }}{% endif %}", {"n": 2}, {"n": 1000}, "'{{ ... }}'"),
    (SHARED + "{{ (s | replace('', s[:n])) | length }}", {"n": 1}, {"n": 1000}, "the replace filter"),
    ("{% set ns = namespace(x=3) %}{% for i in range(n) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x % 1000 }}", {"n": 5}, {"n": 40},
     "'*' of integers (a bit counted as a character)"),
    ("{{ (2 ** n) % 1000 }}", {"n": 64}, {"n": HUGE}, "'**' of integers (a bit counted as a character)"),
]


@pytest.mark.parametrize("template, small, large, named", GROWTHS, ids=[g[3].split(" (")[0].strip("'") + f"-{i}" for i, g in enumerate(GROWTHS)])
def test_a_value_past_the_size_cap_is_refused_before_it_is_built(with_template, template, small, large, named):
    """Each way of growing a value was built whole, whatever its size (2**40 characters for 40
    doublings, 10**10 for a width: gigabytes, or a MemoryError: a 500), and only its writing into
    the prompt was checked; now the value's length is worked out from the arguments first.
    Small, they render as transformers does."""
    from runtime.tokenizer import MAX_RENDERED_CHARS, ChatTemplateTooLarge

    ours, ref = with_template(template)
    mine, theirs = _render_both(ours, ref, MESSAGES, True, **small)
    assert mine == theirs and not isinstance(mine, tuple), (mine, theirs)
    with pytest.raises(ChatTemplateTooLarge, match=rf"^chat_template: {re.escape(named)} would build more than {MAX_RENDERED_CHARS} characters, the limit; "):
        ours.apply_chat_template(MESSAGES, template_kwargs=large)


def test_lipsum_past_the_cap_is_refused(with_template):
    """``lipsum(n)`` wrote n paragraphs of up to 100 words, for any n (random text: not compared with transformers)."""
    from runtime.tokenizer import ChatTemplateTooLarge

    ours, _ = with_template("{{ lipsum(n) | length > 0 }}")
    assert ours.apply_chat_template(MESSAGES, template_kwargs={"n": 2}) == "True"
    with pytest.raises(ChatTemplateTooLarge, match=r"^chat_template: lipsum would build more than "):
        ours.apply_chat_template(MESSAGES, template_kwargs={"n": 10**8})


def test_the_cap_is_the_callers(with_template):
    """``max_chars`` bounds the prompt and every value on the way; a server passes ``size_cap`` of its
    ``--max-request-bytes``: twice the body, never under 16 Mi characters."""
    from runtime.chat_template_sizes import MAX_RENDERED_CHARS, size_cap
    from runtime.tokenizer import ChatTemplateTooLarge

    assert size_cap(1 << 20) == MAX_RENDERED_CHARS and size_cap(64 << 20) == 128 << 20
    ours, _ = with_template("{% set twice = messages[0]['content'] ~ messages[0]['content'] %}{{ twice | length }}")
    messages = [{"role": "user", "content": "x" * 600}]
    assert ours.apply_chat_template(messages, max_chars=1200) == "1200"
    with pytest.raises(ChatTemplateTooLarge, match=r"^chat_template: '~' would build more than 1199 characters"):
        ours.apply_chat_template(messages, max_chars=1199)
    ours, _ = with_template("{{ messages[0]['content'] }}")
    with pytest.raises(ChatTemplateTooLarge, match=r"^chat_template: the prompt these messages render to passes the limit of 599 "):
        ours.apply_chat_template(messages, max_chars=599)


RECURSING = "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(depth) }}{{ messages[0]['content'] }}"


def test_calls_nested_past_the_depth_limit_are_refused(with_template):
    """A macro recursing as deep as a client's input said raised Python's RecursionError past about
    160 levels (a 500 with a traceback per request); calls now nest at most MAX_CALL_DEPTH deep, a
    ChatTemplateTooDeep (a ChatTemplateTooLarge) naming the limit. Up to it, as in transformers."""
    from runtime.chat_template_budget import MAX_CALL_DEPTH
    from runtime.tokenizer import ChatTemplateTooDeep

    ours, ref = with_template(RECURSING)
    mine, theirs = _render_both(ours, ref, MESSAGES, True, depth=MAX_CALL_DEPTH - 1)  # f(0) is the last of MAX_CALL_DEPTH calls
    assert mine == theirs == "hi"
    for depth in (MAX_CALL_DEPTH, 5000):
        with pytest.raises(ChatTemplateTooDeep, match=rf"^chat_template: calls nested more than {MAX_CALL_DEPTH} deep "):
            ours.apply_chat_template(MESSAGES, template_kwargs={"depth": depth})


@pytest.mark.parametrize("template", ["{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
                                      "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}"], ids=["macro", "recursive_loop"])
def test_a_template_that_always_nests_too_deep_is_unusable_from_load(with_template, template):
    """It fails for every input: the checkpoint's fault, known when the tokenizer loads (one short
    message is rendered to see), as a template that does not compile is; one that only some inputs
    drive too deep, or that refuses that message, loads as before."""
    from runtime.tokenizer import ChatTemplateUnusable

    ours, _ = with_template(template)
    assert isinstance(ours.chat_template_problem, ChatTemplateUnusable)
    assert ours.chat_template_problem.reason == "rendering one user message, calls nested more than 64 deep (a macro or a recursive loop calling itself), the limit"
    with pytest.raises(ChatTemplateUnusable):
        ours.apply_chat_template(MESSAGES)
    for fine in (RECURSING, "{{ raise_exception('a system message first') }}"):
        assert with_template(fine)[0].chat_template_problem is None
