"""ValueTooLarge: the longest value one chat template render may build, refused before it is built.

A render's ``RenderBudget`` (``runtime/chat_template_budget.py``) carries ``max_chars``: no text
the template builds, and not the prompt it writes, may be longer (``size_cap``: 16 Mi characters,
or twice the server's ``--max-request-bytes`` when that is larger, so a body the server accepts
is never refused for the size of its own text). ``*`` has a tighter bound of its own
(``tokenizer.MAX_TEMPLATE_REPETITION``). Each way a template grows a value is checked here
against its arguments, before the value exists:

- ``~`` (``bounded_concat``, put in place of every ``~`` when the template is compiled), ``+``
  of strings, lists or tuples (a loop of ``{% set ns.s = ns.s ~ ns.s %}`` doubles a string:
  2**40 characters after 40 turns); ``%`` and the ``format`` filter (``'%*s' % (10**10, 'x')``);
  ``*`` and ``**`` of integers (their bits: squaring in a loop doubles them);
- the filters ``center``, ``indent``, ``join``, ``replace``, ``string``, ``pprint``, ``tojson``,
  ``batch`` and ``slice`` (the latter two fill lists up to a count they are given), and ``lipsum(n)``;
- the string methods ``center``/``ljust``/``rjust``/``zfill`` (a width), ``expandtabs``,
  ``replace``, ``join``, ``translate``, ``format``/``format_map`` (``'{:>10000000000}'.format``);
- what ``{{ ... }}`` writes (the environment's ``finalize``): a list the template built with
  ``[s] * n`` holds ``n`` references to one string, and its text is ``n`` copies of it.

``text_length`` estimates a value's text without making it: exact for a string, close for
containers of JSON values (their items plus 2 characters each; escapes in a ``repr`` may make
the real text a few times longer, which bounds it all the same), and it stops counting once past
the cap, so it costs at most about ``max_chars`` item visits however large the value claims to be.
``range`` needs nothing here: jinja's sandbox caps it at 100 000 items.

What stays open: each value is bounded, not how many a render keeps (a template may build many
values just under the cap in a loop; the step and time budget bounds how many).
"""
from __future__ import annotations

import re
from collections.abc import ItemsView, KeysView, Mapping, ValuesView
from typing import Any, Callable

from jinja2.utils import Namespace

MAX_RENDERED_CHARS = 1 << 24  # the smallest size cap: 16 Mi characters, 16x what the default 1 MiB body carries
SCALAR_CHARS = 32  # the text of a float, bool or None is at most this long
# A printf conversion's width and precision, literal or '*' (taken from the arguments).
PRINTF_NUMBERS = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
FORMAT_NUMBERS = re.compile(r"\d+")  # every number in a str.format field (width, precision, nested or not)


class ValueTooLarge(Exception):
    """A value the render was about to build is longer than its ``max_chars`` (the tokenizer's ChatTemplateTooLarge)."""


def size_cap(max_request_bytes: int) -> int:
    """The ``max_chars`` of a server that takes bodies of up to ``max_request_bytes``: the rendered
    prompt of a conversation is about as long as its JSON (one character per byte at most, plus
    the template's few per message), so twice the body, never under ``MAX_RENDERED_CHARS``."""
    return max(MAX_RENDERED_CHARS, 2 * max_request_bytes)


def text_length(value: Any, limit: int) -> int:
    """About ``len(str(value))``, counted without building it, and no further than past ``limit``."""
    total, pending = 0, [value]
    while pending and total <= limit:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, bool) or item is None or isinstance(item, float):
            total += SCALAR_CHARS
        elif isinstance(item, int):
            total += item.bit_length() * 3 // 10 + 3  # decimal digits, sign
        elif isinstance(item, Mapping):
            total += 2
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)):
            total += 2
            pending.extend(item)
        elif isinstance(item, Namespace):  # its text is its attributes'
            pending.append(item._Namespace__attrs)
        else:  # jinja's own objects (a macro, a loop, an undefined): short texts
            total += len(str(item))
    return total - 2 if isinstance(value, str) else total


def check(context: Any, length: int, what: str) -> None:
    """Raise ValueTooLarge when ``what`` would build more than the render's ``max_chars``."""
    cap = context.budget.max_chars
    if length > cap:
        raise ValueTooLarge(f"chat_template: {what} would build more than {cap} characters, the limit; "
                            "these messages or chat_template_kwargs ask the template for more than a prompt needs")


def _width(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _printf_length(fmt: str, args: Any, limit: int) -> int:
    """``fmt % args`` at most: the format, the arguments' text, and every width and precision."""
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    widths = sum(int(n) for spec in PRINTF_NUMBERS.findall(fmt) for n in spec if n.isdigit())
    if "*" in fmt:
        widths += sum(abs(v) for v in values if isinstance(v, int))
    return len(fmt) + widths + text_length(values, limit)


def _int_bits(operator: str, left: int, right: int) -> int:
    if operator == "*":
        return left.bit_length() + right.bit_length()
    return left.bit_length() * right if right > 0 else 0  # "**"; a negative power is a float


def check_binop(context: Any, operator: str, left: Any, right: Any) -> None:
    """``+`` of strings, lists or tuples; ``%`` of a string; ``*`` and ``**`` of integers, whose
    bits count as characters. (``*`` repeating a sequence is ``tokenizer._check_repetition``'s.)"""
    cap = context.budget.max_chars
    if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        check(context, len(left) + len(right), "'+'")
    elif operator == "%" and isinstance(left, str):
        check(context, _printf_length(left, right, cap), "'%'")
    elif operator in ("*", "**") and type(left) is int and type(right) is int:
        check(context, _int_bits(operator, left, right), f"'{operator}' of integers (a bit counted as a character)")


def bounded_concat(context: Any, parts: tuple[Any, ...]) -> str:
    """``a ~ b ~ ...``: jinja's ``str_join``, once the parts' text is known to fit."""
    check(context, text_length(list(parts), context.budget.max_chars) - 2 - 2 * len(parts), "'~'")
    return "".join(map(str, parts))


def bounded_output(context: Any, value: Any) -> Any:
    """The environment's ``finalize``: what ``{{ value }}`` writes, checked before ``str`` makes it."""
    if not isinstance(value, str):
        check(context, text_length(value, context.budget.max_chars), "'{{ ... }}'")
    return value


def _occurrences(text: Any, old: Any, count: Any) -> int:
    found = len(text) + 1 if old == "" else text.count(old)
    return min(found, count) if isinstance(count, int) and count >= 0 else found


def _replace_length(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    return len(text) + _occurrences(text, old, count) * max(0, len(new) - len(old))


def _indent_length(text: Any, width: Any = 4, *_: Any, **__: Any) -> int:
    per_line = len(width) if isinstance(width, str) else _width(width)
    return len(str(text)) + (str(text).count("\n") + 1) * per_line


def _join_length(limit: int, items: Any, separator: Any = "") -> int:
    if not isinstance(items, (list, tuple, Mapping, set, frozenset)):
        return 0  # a generator: its items are drawn one at a time, each already checked
    return text_length(list(items), limit) + len(items) * len(str(separator))


def _translate_length(text: str, table: Any) -> int:
    longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1) if isinstance(table, Mapping) else 1
    return len(text) * max(1, longest)


def _format_length(limit: int, fmt: str, *args: Any, **kwargs: Any) -> int:
    numbers = sum(int(n) for field in re.findall(r"\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}", fmt) for n in FORMAT_NUMBERS.findall(field))
    nested = sum(abs(v) for v in [*args, *kwargs.values()] if type(v) is int) if "{" in fmt.replace("{{", "") else 0
    return len(fmt) + numbers + nested + text_length([*args, *kwargs.values()], limit)


# filter name -> (estimate(limit, value, *args, **kwargs) of its result's length, in characters or items)
FILTER_LENGTHS: dict[str, Callable[..., int]] = {
    "center": lambda limit, value, width=80: max(len(str(value)), _width(width)),
    "indent": lambda limit, value, *args, **kwargs: _indent_length(value, *args, **kwargs),
    "format": lambda limit, value, *args, **kwargs: _printf_length(str(value), kwargs or args, limit),
    "join": lambda limit, value, d="", attribute=None: _join_length(limit, value, d),
    "replace": lambda limit, value, old, new, count=None: _replace_length(str(value), old, new, -1 if count is None else count),
    "string": lambda limit, value: text_length(value, limit),
    "pprint": lambda limit, value: 2 * text_length(value, limit),
    "tojson": lambda limit, value, *args, **kwargs: text_length(value, limit) * (1 + _json_indent(*args, **kwargs)),
    "batch": lambda limit, value, linecount, fill_with=None: _width(linecount) if fill_with is not None else 0,
    "slice": lambda limit, value, slices, fill_with=None: _width(slices),
}


def _json_indent(ensure_ascii: Any = False, indent: Any = None, *_: Any, **__: Any) -> int:
    return len(indent) if isinstance(indent, str) else _width(indent)


# str method name -> estimate(limit, text, *args, **kwargs) of its result's length
STR_METHOD_LENGTHS: dict[str, Callable[..., int]] = {
    **{name: (lambda limit, text, width=0, *_: max(len(text), _width(width))) for name in ("center", "ljust", "rjust", "zfill")},
    "expandtabs": lambda limit, text, tabsize=8: len(text) + text.count("\t") * max(0, _width(tabsize)),
    "replace": lambda limit, text, old, new, count=-1: _replace_length(text, old, new, count),
    "join": lambda limit, text, items: _join_length(limit, items, text),
    "translate": lambda limit, text, table: _translate_length(text, table),
    "format": _format_length,
    "format_map": lambda limit, text, mapping: _format_length(limit, text, **mapping) if isinstance(mapping, Mapping) else len(text),
}


def check_str_method(context: Any, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A call of one of ``STR_METHOD_LENGTHS``' methods of a string (jinja's sandbox wraps
    ``format``/``format_map`` in a function whose ``__wrapped__`` is the method)."""
    bound = getattr(method, "__wrapped__", method)
    text, name = getattr(bound, "__self__", None), getattr(bound, "__name__", None)
    estimate = STR_METHOD_LENGTHS.get(name) if isinstance(text, str) else None
    if estimate is not None:
        try:
            length = estimate(context.budget.max_chars, text, *args, **kwargs)
        except TypeError:
            return  # arguments the method itself refuses: its own error, with Python's words
        check(context, length, f"str.{name}")


def bounded_filters(filters: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """``FILTER_LENGTHS``' filters of ``filters``, each checking its result's length first; arguments
    the estimate cannot take go to the filter unchecked, which refuses them with its own error."""
    import jinja2

    def bounded(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        kind = getattr(original, "jinja_pass_arg", None)  # jinja's mark of pass_context / pass_eval_context / pass_environment
        estimate = FILTER_LENGTHS[name]

        @jinja2.pass_context
        def checked(context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                length = estimate(context.budget.max_chars, value, *args, **kwargs)
            except TypeError:
                length = 0
            check(context, length, f"the {name} filter")
            first = {"context": (context,), "eval_context": (context.eval_ctx,), "environment": (context.environment,)}
            return original(*first.get(getattr(kind, "name", ""), ()), value, *args, **kwargs)

        return checked

    return {name: bounded(name, filters[name]) for name in FILTER_LENGTHS if name in filters}


def bounded_lipsum(original: Callable[..., str]) -> Callable[..., str]:
    """jinja's ``lipsum(n, html, min, max)``: ``n`` paragraphs of up to ``max`` words of at most 13 characters."""
    import jinja2

    @jinja2.pass_context
    def lipsum(context: Any, n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> str:
        check(context, _width(n) * _width(max) * 13, "lipsum")
        return original(n, html, min, max)

    return lipsum


CONCAT_FILTER = "lorafleet bounded concat"  # not an identifier: templates cannot name it


def install(env: Any) -> None:
    """Give ``env`` (a ``BoundedSandbox``) the bounded filters, ``lipsum``, ``CONCAT_FILTER`` and
    the ``finalize`` that checks what ``{{ ... }}`` writes; before the template is compiled."""
    import jinja2

    env.filters.update(bounded_filters(env.filters))
    env.globals["lipsum"] = bounded_lipsum(env.globals["lipsum"])
    env.filters[CONCAT_FILTER] = jinja2.pass_context(bounded_concat)
    env.finalize = jinja2.pass_context(bounded_output)


def bound_concats(env: Any, tree: Any) -> Any:
    """``tree`` (``env.parse``'s) with every ``a ~ b ~ ...`` made ``(a, b, ...) | CONCAT_FILTER``:
    jinja compiles ``~`` to a join of its own that no sandbox hook sees."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    class ConcatBounder(NodeTransformer):
        def visit_Concat(self, node: Any) -> Any:
            self.generic_visit(node)
            parts = nodes.Tuple(node.nodes, "load", lineno=node.lineno)
            return nodes.Filter(parts, CONCAT_FILTER, [], [], None, None, lineno=node.lineno).set_environment(env)

    return ConcatBounder().visit(tree)
