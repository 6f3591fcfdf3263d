"""RenderBudget: how much work one chat template render may do, in steps, in time and in nested
calls, and how long a value it may build (``max_chars``, checked by ``runtime/chat_template_sizes.py``).

A step is one item that a ``{% for %}`` loop (a recursive loop's ``loop(...)`` too) or a
``range()`` yields, or one call the template makes (a macro, a method such as ``.strip()``, a
function such as ``range``). A render may take ``MAX_TEMPLATE_STEPS`` steps and
``MAX_RENDER_SECONDS`` seconds (the clock is looked at every ``CLOCK_EVERY`` steps); past either
it stops with ``TemplateStepsExhausted`` (the tokenizer's ``ChatTemplateTooLarge``, a 400 on
``messages`` that names the limit). jinja cannot stop a render from outside, and the size limits
(``tokenizer.MAX_RENDERED_CHARS``) never fire for loops that write nothing:
``{% for i in range(n) %}{% for j in range(n) %}`` with ``n`` from a client's
``chat_template_kwargs`` (10**10 items for n = 100000), a macro that calls itself twice per level
(2**depth calls), loops nested over a list the client sent, each ran as long as asked.

Real templates loop over the messages (Qwen3's twice) and make a few calls per message: 1-5 steps
per message for the Llama 3.1-, Qwen 2.5-, Mistral- and Qwen3-style templates that
tests/test_chat_template_parity.py compares with transformers, so the largest conversation a
default 1 MiB body carries (about 35 000 empty messages) takes at most about 140 000 steps, an
eighth of the budget (a server with a much larger ``--max-request-bytes`` may meet it).

Steps are not alike, hence the time limit too: 1 Mi empty loop items take about 0.2 s, 1 Mi calls
of a macro about 9 s (a busy 2-core EPYC, ``/tmp`` scripts, not kept), and a step may work on a
value as large as the request (``big_list | join``). Being time, that limit depends on how busy
the server is; real renders take milliseconds (Qwen3-style: about 1 s for 35 000 messages).

How it is wired (``install``, and ``BoundedSandbox`` in ``runtime/tokenizer.py``): each render's
jinja context (``BudgetedContext``, the environment's ``context_class``) holds a budget of its
own, shared with the contexts jinja derives from it; the environment's ``call`` spends a step per
call (``spend_on_call``); every ``{% for %}``'s iterable passes through the ``COUNTED_FILTER``
filter, put there when the template is compiled (``count_loop_items``), which spends a step per
item; ``range`` is ``CountedRange``, lazy, whose items spend a step each as they are drawn, inside
a loop or out (``range(n) | list``). A template cannot name the filter (its name is not an
identifier), reach the budget, nor set ``range`` (``chat_template_kwargs`` may not).

Calls nest at most ``MAX_CALL_DEPTH`` deep (a macro calling a macro, a recursive loop's
``loop(...)``, a call block's ``caller()``): past it, ``TemplateCallsTooDeep`` (the tokenizer's
``ChatTemplateTooDeep``). Without it, a macro recursing as deep as a client's input said raised
Python's RecursionError (a 500 and a traceback per request) once its frames, about 6 per nested
macro call, reached Python's limit of 1000: about 160 levels. 64 leaves the frames of the
caller and of the template's filters room; real templates nest 3 calls at most.
"""
from __future__ import annotations

from time import monotonic
from typing import Any, Callable, Iterable, Iterator

from runtime.chat_template_sizes import MAX_RENDERED_CHARS

MAX_TEMPLATE_STEPS = 1 << 20  # steps of one render: 1 Mi
MAX_RENDER_SECONDS = 10.0  # one render's time, looked at every CLOCK_EVERY steps
CLOCK_EVERY = 64
MAX_CALL_DEPTH = 64  # calls nested inside one another in one render
COUNTED_FILTER = "lorafleet counted loop"  # not an identifier: templates cannot name it


class TemplateStepsExhausted(Exception):
    """The render took more than its budget of steps (``RenderBudget``)."""


class TemplateCallsTooDeep(Exception):
    """The render nested calls deeper than its budget's ``max_depth`` (``RenderBudget.enter_call``)."""


class RenderBudget:
    """``steps`` steps and ``seconds`` of ``clock`` (from the budget's making) for one render.
    ``spend`` takes a step, and raises ``TemplateStepsExhausted`` once more than ``steps`` were
    taken, or, looking at the clock every ``CLOCK_EVERY`` steps, once ``seconds`` have passed
    (and again at every later step, so a caller that swallowed the error cannot go on).
    ``enter_call`` / ``leave_call`` bracket a call: more than ``max_depth`` open at once raises
    ``TemplateCallsTooDeep``. ``max_chars``: the longest value the render may build
    (``runtime/chat_template_sizes.py``)."""

    def __init__(self, steps: int, seconds: float, clock: Callable[[], float] = monotonic,
                 max_chars: int = MAX_RENDERED_CHARS, max_depth: int = MAX_CALL_DEPTH) -> None:
        self.steps, self.seconds, self._clock = steps, seconds, clock
        self.max_chars, self.max_depth = max_chars, max_depth
        self.left = steps
        self.depth = 0
        self._deadline = clock() + seconds

    def enter_call(self) -> None:
        if self.depth >= self.max_depth:
            raise TemplateCallsTooDeep(
                f"chat_template: calls nested more than {self.max_depth} deep (a macro or a recursive loop calling itself), the limit; "
                "these messages or chat_template_kwargs ask the template for more than a prompt needs")
        self.depth += 1

    def leave_call(self) -> None:
        self.depth -= 1

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise TemplateStepsExhausted(
                f"chat_template: the render took more than {self.steps} steps (loop items, range items and calls), the limit; "
                "these messages or chat_template_kwargs ask the template for more work than a prompt needs")
        if self.left % CLOCK_EVERY == 0 and self._clock() > self._deadline:
            self.left = -1  # every later step fails too
            raise TemplateStepsExhausted(
                f"chat_template: the render took more than {self.seconds:g} s, the limit; "
                "these messages or chat_template_kwargs ask the template for more work than a prompt needs")

    def counted(self, items: Iterable[Any]) -> Iterator[Any]:
        """``items``' items, a step each as it is drawn. ``iter(items)`` is taken now, so an
        object that cannot be iterated fails where the loop starts, with Python's own error."""
        return self._counted(iter(items))

    def _counted(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for item in iterator:
            self.spend()
            yield item


class CountedRange:
    """``range(*args)`` as jinja's sandbox makes it (``safe_range``: at most ``MAX_RANGE`` items,
    else its OverflowError), lazy, whose items spend a step each as they are drawn (forwards,
    backwards, or through a filter such as ``list``). Length, indexing, slicing (another
    CountedRange), ``in``, ``start``/``stop``/``step``/``index``/``count`` and its text
    (``range(0, 3)``) are the range's."""

    def __init__(self, budget: RenderBudget, items: range) -> None:
        self._budget, self._items = budget, items

    def __iter__(self) -> Iterator[int]:
        return self._budget.counted(self._items)

    def __reversed__(self) -> Iterator[int]:
        return self._budget.counted(reversed(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        found = self._items[index]
        return CountedRange(self._budget, found) if isinstance(found, range) else found

    def __contains__(self, value: Any) -> bool:
        return value in self._items

    def __eq__(self, other: Any) -> bool:
        return self._items == (other._items if isinstance(other, CountedRange) else other)

    def __hash__(self) -> int:
        return hash(self._items)

    def __repr__(self) -> str:
        return repr(self._items)

    @property
    def start(self) -> int:
        return self._items.start

    @property
    def stop(self) -> int:
        return self._items.stop

    @property
    def step(self) -> int:
        return self._items.step

    def index(self, value: Any) -> int:
        return self._items.index(value)

    def count(self, value: Any) -> int:
        return self._items.count(value)


def render_budget(max_chars: int) -> RenderBudget:
    """A fresh budget for one render: ``MAX_TEMPLATE_STEPS`` steps, ``MAX_RENDER_SECONDS``, values of at most ``max_chars``."""
    return RenderBudget(MAX_TEMPLATE_STEPS, MAX_RENDER_SECONDS, monotonic, max_chars=max_chars)


def budgeted_context_class() -> type:
    """jinja's ``Context`` with a ``budget`` (a fresh ``render_budget`` per render; the tokenizer
    gives each render its own, with the caller's ``max_chars``), which the contexts jinja derives from it during the render (a ``pass_context``
    call inside a loop, a block) share."""
    from jinja2.runtime import Context

    class BudgetedContext(Context):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.budget = render_budget(MAX_RENDERED_CHARS)

        def derived(self, locals: Any = None) -> "BudgetedContext":
            context = super().derived(locals)
            context.budget = self.budget
            return context

    return BudgetedContext


def spend_on_call(context: Any, obj: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A call the template makes: one step; the arguments to call ``obj`` with. A recursive loop's
    ``loop(items)`` gets ``items`` counted, as the loop's own iterable is."""
    from jinja2.runtime import LoopContext

    context.budget.spend()
    if isinstance(obj, LoopContext) and args:
        return (context.budget.counted(args[0]), *args[1:])
    return args


def install(env: Any) -> None:
    """Give ``env`` (a ``BoundedSandbox``, whose ``context_class`` is ``budgeted_context_class()``
    and whose ``call`` uses ``spend_on_call``) the counted ``range`` and ``COUNTED_FILTER``."""
    import jinja2
    from jinja2.sandbox import safe_range

    @jinja2.pass_context
    def counted_range(context: Any, *args: int) -> CountedRange:
        return CountedRange(context.budget, safe_range(*args))

    @jinja2.pass_context
    def counted_loop(context: Any, items: Any) -> Any:
        return items if isinstance(items, CountedRange) else context.budget.counted(items)  # a range counts its own items

    env.globals["range"] = counted_range
    env.filters[COUNTED_FILTER] = counted_loop


def count_loop_items(env: Any, tree: Any) -> Any:
    """``tree`` (``env.parse``'s) with every ``{% for %}``'s iterable passed through ``COUNTED_FILTER``."""
    from jinja2 import nodes

    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Filter(loop.iter, COUNTED_FILTER, [], [], None, None, lineno=loop.iter.lineno).set_environment(env)
    return tree
