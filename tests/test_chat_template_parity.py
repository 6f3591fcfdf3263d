"""Chat templates in the style of real checkpoints' rendered by lorafleet's Tokenizer and by
transformers' AutoTokenizer (the reference, 5.24) on the same tiny tokenizer: the same text, or both
refusing. Also the template environment's own refusals (transformers' ``namespace`` and ``dict``)."""
from __future__ import annotations

import json
import math
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from runtime.tokenizer import Tokenizer, TokenizerError

# Llama 3.1's shape: strftime_now for the date, tools tested against none, the system message moved out, trim.
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen2.5's: `if tools` (None here) picks the default system prompt, attribute access to keys, tool_calls undefined.
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Mistral's (v0.1 family): raise_exception unless the roles alternate user/assistant after an optional system message.
MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# Qwen3's: a namespace found by a reversed loop with {% break %}, {% continue %}, <think> split off, enable_thinking;
# plus dict(...) and dict.fromkeys, which transformers' narrower dict keeps.
QWEN3 = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- set tags = dict(open='<|im_start|>', close='<|im_end|>') %}
{%- set seen = dict.fromkeys(['user', 'assistant'], 0) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not message.content.startswith('<tool_response>') %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "system" and not loop.first %}
        {%- continue %}
    {%- endif %}
    {%- set content = message.content %}
    {%- set reasoning_content = '' %}
    {%- if message.role == "assistant" and '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {%- if message.role == "assistant" and loop.index0 > ns.last_query_index and reasoning_content %}
        {{- tags.open + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') + tags.close + '\\n' }}
    {%- else %}
        {{- tags.open + message.role + '\\n' + content + tags.close + '\\n' }}
    {%- endif %}
{%- endfor %}
{{- seen | tojson }}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

CONVERSATIONS = {
    "system_first": [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "<think>\nsay hello\n</think>\n\nhello"}, {"role": "user", "content": "and <b> & ü?"}],
    "no_system": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "so"}],
    "after_the_answer": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>x</think>a"}],
    "two_users": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
    "late_system": [{"role": "user", "content": "u"}, {"role": "system", "content": "late"}, {"role": "assistant", "content": "a"}],
    # OpenAI's null content of an assistant turn with no text: transformers leaves the key out (it had been passed as None)
    "null_content": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "so"}],
}


class FixedNow(datetime):
    @classmethod
    def now(cls, tz=None):  # type: ignore[override]
        return cls(2026, 3, 4, 5, 6, 7)


@pytest.fixture
def with_template(tmp_path, tiny_llama_dir, monkeypatch):
    """``(template) -> (lorafleet's Tokenizer, transformers' AutoTokenizer)`` of a tiny llama copy with
    that template; strftime_now's clock fixed in both, so a render straddling midnight cannot differ."""
    import transformers.utils.chat_template_utils as hf_template_utils

    import runtime.tokenizer

    monkeypatch.setattr(runtime.tokenizer, "datetime", FixedNow)
    monkeypatch.setattr(hf_template_utils, "datetime", FixedNow)

    def load(template: str):
        from transformers import AutoTokenizer

        folder = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_llama_dir, folder)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
        return Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))

    return load


def _render_both(ours, ref, messages, add_generation_prompt, **kwargs):
    """Each side's text, or ``("refused", its message)``."""
    results = []
    for render in (lambda: ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, template_kwargs=kwargs),
                   lambda: ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)):
        try:
            results.append(render())
        except Exception as err:  # lorafleet's TokenizerError, transformers' jinja TemplateError
            results.append(("refused", str(err).removeprefix("chat_template: ").removeprefix("cannot render: ")))  # lorafleet's words for a jinja error
    return results


@pytest.mark.parametrize("template", [LLAMA3, QWEN25, MISTRAL, QWEN3], ids=["llama3", "qwen2.5", "mistral", "qwen3"])
def test_real_world_style_templates_render_as_in_transformers(with_template, template):
    ours, ref = with_template(template)
    for (name, messages), add in zip(sorted(CONVERSATIONS.items()) * 2, [True] * len(CONVERSATIONS) + [False] * len(CONVERSATIONS)):
        for kwargs in ({}, {"enable_thinking": False}):
            mine, want = _render_both(ours, ref, messages, add, **kwargs)
            assert mine == want, (name, add, kwargs)
    if template is LLAMA3:
        assert "Today Date: 04 Mar 2026\n\nBe brief.<|eot_id|>" in ours.apply_chat_template(CONVERSATIONS["system_first"])
    if template is QWEN3:  # the reasoning of the answer after the last user turn only, and the dicts' texts
        assert ours.apply_chat_template(CONVERSATIONS["after_the_answer"], add_generation_prompt=False) == (
            '<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\nx\n</think>\n\na<|im_end|>\n{"user": 0, "assistant": 0}')
    if template is MISTRAL:  # the alternation check refuses in both, with the template's message
        assert _render_both(ours, ref, CONVERSATIONS["two_users"], True)[0] == ("refused", "After the optional system message, conversation "
                                                                                 "roles must alternate user/assistant/user/assistant/...")


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(_hidden=1) %}{{ messages[0]['content'] }}",
    "{% set ns = namespace(count=0) %}{% set ns._count = 1 %}{{ messages[0]['content'] }}",
], ids=["in_the_call", "set_later"])
def test_a_namespace_attribute_starting_with_an_underscore_is_refused_as_in_transformers(with_template, template):
    """transformers' namespace refuses such names (they lead towards CPython internals); jinja's,
    which lorafleet used, stored them and rendered the messages."""
    ours, ref = with_template(template)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(Exception, match="cannot store underscore-prefixed attributes on a namespace"):
        ref.apply_chat_template(messages, tokenize=False)
    with pytest.raises(TokenizerError, match=r"^chat_template: cannot render: Chat templates cannot store underscore-prefixed attributes "
                                             r"on a namespace, but got '_(hidden|count)'"):
        ours.apply_chat_template(messages)


@pytest.mark.parametrize("template", [
    "{% set d = {'a': 1} %}{% set _ = dict.update(d, {'b': 2}) %}{{ d | tojson }}",
    "{{ dict.keys(messages[0]) | list }}",
], ids=["update_mutates", "keys"])
def test_dict_is_transformers_narrow_one(with_template, template):
    """A template's ``dict`` is a call or ``dict.fromkeys`` only, as in transformers; with jinja's,
    ``dict.update(d, ...)`` changed a dict inside the immutable sandbox and ``dict.keys(m)`` rendered."""
    ours, ref = with_template(template)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(Exception, match="has no attribute"):
        ref.apply_chat_template(messages, tokenize=False)
    with pytest.raises(TokenizerError, match=r"^chat_template: cannot render: .* has no attribute '(update|keys)'"):
        ours.apply_chat_template(messages)


# A template that repeats strings and lists as many times as chat_template_kwargs say, either operand first.
REPEATS = ("{{ '-' * width }}{{ rule * '=' if rule is defined }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
           "[{{ (['a', 'b'] * copies) | length }}]")


def test_a_repetition_past_the_limit_is_refused_before_it_is_built(with_template):
    """jinja's sandbox bounds range() but built whatever ``'x' * n`` asked for: with ``n`` from a
    client's chat_template_kwargs, gigabytes (or a MemoryError, a 500). Repetitions up to
    MAX_TEMPLATE_REPETITION items render as in transformers; one past it is refused, naming the limit."""
    from runtime.tokenizer import MAX_TEMPLATE_REPETITION, ChatTemplateTooLarge

    ours, ref = with_template(REPEATS)
    messages = [{"role": "user", "content": "hi"}]
    for kwargs in ({"width": 40, "copies": 3, "rule": 2}, {"width": MAX_TEMPLATE_REPETITION, "copies": MAX_TEMPLATE_REPETITION // 2}):
        assert _render_both(ours, ref, messages, True, **kwargs) == 2 * [ref.apply_chat_template(messages, tokenize=False, **kwargs)]
    over = MAX_TEMPLATE_REPETITION // 2 + 1
    too_many = [({"width": MAX_TEMPLATE_REPETITION + 1, "copies": 1}, f"a str of {MAX_TEMPLATE_REPETITION + 1} characters \\(1 x {MAX_TEMPLATE_REPETITION + 1}\\)"),
                ({"width": 1, "copies": 1, "rule": 2**62}, f"a str of {2**62} characters \\(1 x {2**62}\\)"),
                ({"width": 1, "copies": over}, f"a list of {2 * over} items \\(2 x {over}\\)")]
    for kwargs, what in too_many:
        with pytest.raises(ChatTemplateTooLarge, match=rf"^chat_template: '\*' would build {what}, past the limit of {MAX_TEMPLATE_REPETITION} "):
            ours.apply_chat_template(messages, template_kwargs=kwargs)


def test_a_rendered_prompt_past_the_limit_is_refused_as_it_grows(with_template):
    """A loop that writes the messages as many times as chat_template_kwargs say built the whole
    text, however long; the render now stops once the text passes MAX_RENDERED_CHARS."""
    from runtime.tokenizer import MAX_RENDERED_CHARS, ChatTemplateTooLarge

    ours, _ = with_template("{% for i in range(times) %}{{ messages[0]['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "x" * 200}]
    fits = MAX_RENDERED_CHARS // 200
    assert ours.apply_chat_template(messages, template_kwargs={"times": fits}) == "x" * (200 * fits)
    with pytest.raises(ChatTemplateTooLarge, match=rf"^chat_template: the prompt these messages render to passes the limit of {MAX_RENDERED_CHARS} "):
        ours.apply_chat_template(messages, template_kwargs={"times": fits + 1})


# range() every way a template may use it, and loops with a filter, an else, loop.length and recursion.
RANGES = ("{{ range(3) }}|{{ range(3) | list }}|{{ range(5) | reverse | list }}|{{ range(10)[2:5] | list }}|{{ range(3) | length }}|"
          "{% for i in range(4) %}{{ loop.length }}{{ loop.last }}{% endfor %}|{{ range(2, 10, 3) | last }}|{{ 2 in range(3) }}|"
          "{{ range(3).stop }}|{{ range(n) | sum }}|{% for x in range(n) if x > 1 %}{{ x }}{{ loop.last }}{% else %}none{% endfor %}|"
          "{% for x in [] %}x{% else %}empty{% endfor %}|{% for m in messages %}{{ loop.revindex }}{{ m['content'] }}{% endfor %}|"
          "{% for t in tree recursive %}[{{ t.v }}{% if t.c %}{{ loop(t.c) }}{% endif %}]{% endfor %}")


def test_range_and_loops_render_as_in_transformers(with_template):
    """lorafleet's range is lazy and counts its items against the render's budget of steps, and
    every loop's items pass through a counting filter; the text is transformers'."""
    ours, ref = with_template(RANGES)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]
    tree = [{"v": 1, "c": [{"v": 2, "c": []}, {"v": 3}]}]
    for n in (0, 3, 7):
        mine, want = _render_both(ours, ref, messages, False, n=n, tree=tree)
        assert mine == want and isinstance(mine, str), n
    with pytest.raises(TokenizerError, match="OverflowError: Range too big"):  # jinja's sandbox's MAX_RANGE, as in transformers
        ours.apply_chat_template(messages, template_kwargs={"n": 100_001})


@pytest.mark.parametrize("template, kwargs", [
    ("{% for i in range(n) %}{% for j in range(n) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}", "n"),
    ("{% for a in xs %}{% for b in xs %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}", "xs"),
    ("{% for i in range(n) %}{% set _ = range(n) | list %}{% endfor %}{{ messages[0]['content'] }}", "n"),
], ids=["nested_ranges", "nested_loops_over_a_kwarg_list", "ranges_listed_in_a_loop"])
def test_a_render_past_its_budget_of_steps_is_refused(with_template, template, kwargs):
    """Loops that write nothing never met the size limits: nested loops over a client's
    ``range(n)`` (or over a list it sent) ran n**2 times, 10**10 for n = 100000, holding a thread
    for hours. Past MAX_TEMPLATE_STEPS loop items, range items and calls, the render stops with
    ChatTemplateTooLarge naming the limit; just below it, it renders as before."""
    from runtime.chat_template_budget import MAX_TEMPLATE_STEPS
    from runtime.tokenizer import ChatTemplateTooLarge

    ours, _ = with_template(template)
    messages = [{"role": "user", "content": "hi"}]
    side = math.isqrt(MAX_TEMPLATE_STEPS)  # side**2 + side (the outer items) + 1 (the call) is just past the limit
    value = (lambda n: n) if kwargs == "n" else (lambda n: list(range(n)))
    assert ours.apply_chat_template(messages, template_kwargs={kwargs: value(side // 2)}) == "hi"
    with pytest.raises(ChatTemplateTooLarge, match=rf"^chat_template: the render took more than {MAX_TEMPLATE_STEPS} steps \(loop items, "
                                                   r"range items and calls\), the limit; these messages or chat_template_kwargs ask"):
        ours.apply_chat_template(messages, template_kwargs={kwargs: value(side)})


@pytest.mark.parametrize("template", [
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(depth) }}",
    "{% for x in xs recursive %}{% if depth > loop.depth %}{{ loop(xs) }}{% endif %}{% endfor %}",
], ids=["macro_calling_itself_twice", "recursive_loop"])
def test_calls_and_recursive_loops_spend_steps(with_template, monkeypatch, template):
    """Without a loop of its own a template can still work exponentially long: a macro calling
    itself twice per level (2**depth calls), a recursive loop over the same items again. Every call
    is a step, and so is every item of a recursive ``loop(...)``. (The budget is made small here,
    so the test is quick.)"""
    import runtime.chat_template_budget as budget
    from runtime.tokenizer import ChatTemplateTooLarge

    monkeypatch.setattr(budget, "MAX_TEMPLATE_STEPS", 5000)
    ours, _ = with_template(template)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, template_kwargs={"depth": 4, "xs": [1, 2]}) == ""
    with pytest.raises(ChatTemplateTooLarge, match="^chat_template: the render took more than 5000 steps"):
        ours.apply_chat_template(messages, template_kwargs={"depth": 13, "xs": [1, 2]})


def test_a_render_past_its_time_is_refused(with_template, monkeypatch):
    """Steps are not all alike (a macro call costs tens of loop items; a step may work on a 1 MiB
    value): a render also stops once MAX_RENDER_SECONDS have passed, looking at the clock every
    CLOCK_EVERY steps. The clock is the test's: each look advances it by a second."""
    import runtime.chat_template_budget as budget
    from runtime.tokenizer import ChatTemplateTooLarge

    ours, _ = with_template("{% for i in range(n) %}{% endfor %}{{ messages[0]['content'] }}")
    messages = [{"role": "user", "content": "hi"}]
    looks = iter(range(10**6))
    monkeypatch.setattr(budget, "monotonic", lambda: float(next(looks)))
    looks_allowed = int(budget.MAX_RENDER_SECONDS)  # the look at the start, then one every CLOCK_EVERY steps
    assert ours.apply_chat_template(messages, template_kwargs={"n": budget.CLOCK_EVERY * (looks_allowed - 1)}) == "hi"
    with pytest.raises(ChatTemplateTooLarge, match=rf"^chat_template: the render took more than {budget.MAX_RENDER_SECONDS:g} s, the limit"):
        ours.apply_chat_template(messages, template_kwargs={"n": budget.CLOCK_EVERY * (looks_allowed + 2)})
