"""Shared generation plumbing for the completions and chat routes.

Maps an API request to engine calls: the model name to an adapter (or the base),
the sampling fields to ``SamplingParams``, engine errors to OpenAI-style errors,
and one or more prompts to merged output streams. A consumer that goes away
(client disconnect) closes the engine's stream, which aborts the request there.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence

from runtime.async_engine import EngineDeadError, GroupRefused, admits_groups
from runtime.request import PromptTooLongError, RequestRejected, SamplingParams, UnknownAdapterError
from runtime.server.chat_render_workers import ChatRenderBusy, ChatRenderWorkers
from runtime.server.errors import APIError, error_body, internal_error_body
from runtime.server.protocol import CHAT_TEMPLATE_FIELDS, _SamplingFields
from runtime.chat_template_sizes import MAX_RENDERED_CHARS
from runtime.tokenizer import LONG_TEXT_CHARS, ChatTemplateError, ChatTemplateTooDeep, ChatTemplateUnusable

DEFAULT_COMPLETION_TOKENS = 16
# SamplingParams.seed is in [0, SEED_MODULUS); a request's seed is any int64, taken modulo this (two's complement).
SEED_MODULUS = 2**64
log = logging.getLogger("lorafleet.requests")
server_log = logging.getLogger("lorafleet.server")  # errors.py's: what the operator should look at


@dataclass(frozen=True)
class Target:
    """What a request's ``model`` field names: the base (adapter None) or an adapter."""

    model: str
    adapter: str | None


def resolve_model(engine: Any, base_name: str, model: str) -> Target:
    """Map the request's ``model`` to the base or an adapter; lock-free (``engine.adapters()`` is)."""
    if model == base_name:
        return Target(model, None)
    if any(info.name == model for info in engine.adapters()):
        return Target(model, model)
    raise APIError(404, f"model {model!r} does not exist; GET /v1/models lists the base model and its adapters", param="model", code="model_not_found")


async def off_loop_if_long(size: int, work: Callable[[], Any]) -> Any:
    """``work()``, in a worker thread when ``size`` is that of a long text (``LONG_TEXT_CHARS``),
    so the event loop goes on serving other streams meanwhile."""
    return work() if size < LONG_TEXT_CHARS else await asyncio.to_thread(work)


async def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text)`` without stalling the event loop: a long text (a prompt near the
    body limit takes about a second) is encoded in a worker thread, which the tokenizer runs
    without the GIL (``runtime/tokenizer.py``), so other streams and the step loop go on."""
    return await off_loop_if_long(len(text), lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))


async def render_chat_off_loop(workers: ChatRenderWorkers, tokenizer: Any, request: Any, max_chars: int = MAX_RENDERED_CHARS) -> str:
    """``render_chat(tokenizer, request)`` in one of ``workers``' threads (the app's
    ``ChatRenderWorkers``), whatever the request's size; its errors are ``render_chat``'s, raised
    here, and a 429 ``too_many_chat_renders`` when ``workers`` has as many renders in progress as
    it takes. On the event loop, a template that takes long (a long conversation, loops over
    ``chat_template_kwargs``' values) held up every other request, ``/health`` and ``/metrics``
    included, for as long as it ran; on the loop's default executor, a few of them took the
    threads ``/metrics`` and long prompts' tokenizing wait for.

    Unlike tokenizing (``off_loop_if_long``), there is no size below which a render stays on the
    loop: its cost follows from the checkpoint's template, not from the input's size alone (a few
    short messages can drive a loop of ``range(100000)``). A typical render is about as cheap as
    the hop: 20-70 us for 4 short messages with Llama 3.1-, Qwen 2.5/3- and Mistral-style
    templates, 0.2-1.9 ms for 200 messages of 1 KB, and 55 us for a round trip through
    ``asyncio.to_thread`` (2-core AMD EPYC, a ``/tmp`` script, not kept), which is nothing next
    to the request's prefill. A render cannot be stopped from outside once started (not by a
    client that goes away either); it holds its thread until it ends. What it builds is bounded
    (``tokenizer.MAX_TEMPLATE_REPETITION``; ``max_chars``, the routes' ``chat_template_sizes.size_cap``
    of the server's ``--max-request-bytes``), and so is what it does
    (``chat_template_budget.MAX_TEMPLATE_STEPS``, ``MAX_RENDER_SECONDS``, ``MAX_CALL_DEPTH``)."""
    try:
        return await workers.run(render_chat, tokenizer, request, max_chars)
    except ChatRenderBusy as err:
        raise APIError(429, str(err), code="too_many_chat_renders") from err


def render_chat(tokenizer: Any, request: Any, max_chars: int = MAX_RENDERED_CHARS) -> str:
    """The chat template's text for a request's ``messages`` (pydantic chat messages), with its chat
    template fields (``protocol.CHAT_TEMPLATE_FIELDS``). ``continue_final_message`` needs
    ``add_generation_prompt`` false (vLLM's rule), else a 400 on it; it continues the last message
    whatever its role (as vLLM and transformers do); a template that does not write that message's
    content as given is a 400 on it too. A ``chat_template_kwargs`` key the render sets itself is a
    400 on that field (a special token's overrides it, as in transformers).
    A refusal by the template (its ``raise_exception``, a sandbox violation, a limit of its
    render) is a 400 on the inputs that drove the render (``template_inputs``: ``messages``, and
    ``chat_template_kwargs`` when the request sent any, since either may have), whose text starts
    with their names, as every field's error does. So is a Python error the template's code
    raises on the request's values (ChatTemplateError: e.g. a TypeError); as it may as well be the
    template's fault, it is also logged, with its traceback, on ``lorafleet.server``; calls nested
    past the limit (ChatTemplateTooDeep) are logged there too, without one (the template and the
    inputs say it all). A template that cannot render anything (ChatTemplateUnusable: it does
    not compile, found at load and logged by ``create_app``) is the server's fault: a 500,
    ``chat_template_unusable``, that says so with jinja's reason."""
    messages = request.messages
    if request.continue_final_message and request.add_generation_prompt:
        raise APIError(400, "continue_final_message: not with add_generation_prompt: true (the default), which starts a new message; "
                       "send add_generation_prompt: false", param="continue_final_message", code="invalid_parameter")
    try:
        return tokenizer.apply_chat_template([m.template_fields() for m in messages], add_generation_prompt=request.add_generation_prompt,
                                             continue_final_message=request.continue_final_message,
                                             template_kwargs=request.chat_template_kwargs, max_chars=max_chars)  # fmt: skip
    except ChatTemplateUnusable as err:
        raise APIError(500, f"the server's chat template cannot be used ({err.reason}); chat fails until the server's operator "
                       "fixes it (completions work)", code="chat_template_unusable") from err
    except ValueError as err:
        if isinstance(err, ChatTemplateError):
            server_log.warning("the chat template failed on a request's values: %s", err, exc_info=err.__cause__)
        elif isinstance(err, ChatTemplateTooDeep):
            server_log.warning("the chat template nested its calls too deep on a request's values: %s", err)
        message = str(err)
        fields = [field for field in CHAT_TEMPLATE_FIELDS if message.startswith(f"{field}:")]
        param = template_inputs(request) if message.startswith("chat_template:") else (fields or ["messages"])[0]
        raise APIError(400, message if message.startswith(param) else f"{param}: {message}", param=param, code="invalid_parameter") from err


def template_inputs(request: Any) -> str:
    """What a template's failure names: ``messages``, or ``messages, chat_template_kwargs`` when the
    request sent variables too. The template is the server's and fixed, so the inputs drove it,
    and which of the two cannot be told from the failure (``'-' * width`` fails on the kwargs'
    width; a loop over the messages on their number)."""
    return "messages, chat_template_kwargs" if request.chat_template_kwargs else "messages"


def sampling_params(req: _SamplingFields, max_tokens: int, logprobs: Optional[int] = None, prompt_logprobs: Optional[int] = None) -> SamplingParams:
    """The request's SamplingParams; ``logprobs``: alternatives per token (None: no logprobs), which
    completions and chat spell differently; ``prompt_logprobs``: the same for the prompt's tokens (echo)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,  # -1 (off) is SamplingParams' to map, as offline
            min_p=req.min_p,
            seed=None if req.seed is None else req.seed % SEED_MODULUS,  # int64 -> the sampler's [0, 2**64), two's complement
            stop=tuple(stops),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias_ids(req.logit_bias),
            min_tokens=req.min_tokens,
        )
    except ValueError as err:  # the message starts with the field it is about ("min_tokens: ...")
        field = str(err).split(":", 1)[0]
        raise APIError(400, str(err), param=field if field in type(req).model_fields else None, code="invalid_parameter") from err


def logit_bias_ids(bias: Optional[dict[str, float]]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids written as decimal strings) with int keys; two keys
    naming one id ("7" and "07") are a 400, not one silently winning."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        token = int(key)
        if token in out:
            raise APIError(400, f"logit_bias: keys {key!r} and another one both name token {token}", param="logit_bias", code="invalid_parameter")
        out[token] = float(value)
    return out


def default_max_tokens(default: int, prompt_len: int, max_seq_tokens: int) -> int:
    """max_tokens for a request that sent none: ``default``, capped to the room the prompt leaves
    of ``max_seq_tokens``; at least 1, so a prompt with no room gets the engine's error about the
    prompt, never one about a max_tokens the client did not send."""
    return max(1, min(default, max_seq_tokens - prompt_len))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def log_request(request_id: str, body: _SamplingFields, target: Target) -> None:
    """One access-log line per generation request (with the caller's ``user`` field, if given).
    Client strings that are not plain printable text (a newline would forge a log line) are
    written as Python literals."""
    log.info("%s model=%s adapter=%s user=%s stream=%s", request_id, _printable(body.model), target.adapter or "-", _printable(body.user or "-"), body.stream)


def _printable(text: str) -> str:
    return text if text.isprintable() else repr(text)


async def open_stream(
    engine: Any, request_id: str, prompt: str | list[int], params: SamplingParams, adapter: str | None, prompt_param: str = "prompt",
    group: Any = None,
) -> tuple[Any, AsyncIterator[Any]]:
    """Start a request and wait for its first output, so admission errors become HTTP errors.

    ``prompt_param``: the request field an error about the prompt names (``prompt``,
    ``prompt.3`` for one of several, ``messages`` for chat); an error the engine words as being
    about max_tokens names ``max_tokens``. ``group``: the engine's admission group this request
    belongs to (``open_streams``). Returns (first_output, the rest of the stream).
    """
    stream = engine.generate(request_id, prompt, params, adapter) if group is None else engine.generate(request_id, prompt, params, adapter, group=group)
    try:
        first = await stream.__anext__()
    except UnknownAdapterError as err:
        raise APIError(404, str(err), param="model", code="model_not_found") from err
    except (PromptTooLongError, RequestRejected) as err:
        raise APIError(400, str(err), param=_param_of(str(err), prompt_param, prompt_param), code="context_length_exceeded") from err
    except EngineDeadError as err:  # a RuntimeError: the engine died or is shutting down
        raise APIError(503, str(err), code="engine_unavailable") from err
    except ValueError as err:
        raise APIError(400, str(err), param=_param_of(str(err), prompt_param, None), code="invalid_parameter") from err
    except StopAsyncIteration as err:
        raise APIError(500, f"request {request_id} ended without output") from err
    return first, stream


def _param_of(message: str, prompt_param: str, default: Optional[str]) -> Optional[str]:
    """The field an engine error message is about, from its prefix: ``max_tokens:``, ``logit_bias:``,
    ``stop_token_ids:``, ``min_tokens:`` name themselves, ``prompt:`` gives ``prompt_param``; else ``default``."""
    field = message.split(":", 1)[0]
    if field in ("max_tokens", "logit_bias", "stop_token_ids", "min_tokens"):
        return field
    if field == "prompt":
        return prompt_param
    return default


def choices_of(prompts: Sequence[str | list[int]], params: Sequence[SamplingParams], n: int) -> tuple[list[str | list[int]], list[SamplingParams]]:
    """Each prompt ``n`` times, as choices ``i * n + j`` (OpenAI's order). Sample j of a seeded
    request gets seed ``seed + j`` (mod 2**64, the sampler's range; the same as adding in int64 and
    wrapping, so choice j is what seed + j alone gives), so the n samples differ and the request stays
    reproducible; unseeded samples draw their own seeds; greedy ones are all alike."""
    def seeded(p: SamplingParams, j: int) -> SamplingParams:
        return p if j == 0 or p.seed is None else dataclasses.replace(p, seed=(p.seed + j) % SEED_MODULUS)

    return [p for p in prompts for _ in range(n)], [seeded(p, j) for p in params for j in range(n)]


async def open_streams(
    engine: Any, request_id: str, prompts: Sequence[str | list[int]], params: Sequence[SamplingParams], adapter: str | None,
    prompt_param: str = "prompt", copies: int = 1,
) -> list[tuple[Any, AsyncIterator[Any]]]:
    """``open_stream`` for every prompt at once (request ids ``<request_id>-<i>``), then wait for all.

    ``copies``: each prompt of the request appears that many times in a row (``n`` choices per
    prompt, ``choices_of``); errors then name the request's prompt, ``k // copies``.
    If one fails, the first failure in prompt order among the admissions done by then is raised
    (later ones are cancelled); then, or when this is cancelled
    (the client went away), every stream already opened is closed and every admission still
    pending is cancelled, which aborts their engine requests.
    """
    distinct = len(prompts) // copies

    def param(k: int) -> str:
        return f"{prompt_param}.{k // copies}" if distinct > 1 else prompt_param

    # One admission group: every engine request of this HTTP request binds to the same adapter
    # version, even during a hot reload. An engine without groups (a Ray ingress) admits each alone.
    group = engine.admission_group(len(prompts)) if len(prompts) > 1 and admits_groups(engine) else None
    tasks = [asyncio.ensure_future(open_stream(engine, f"{request_id}-{k}", p, ps, adapter, param(k), group)) for k, (p, ps) in enumerate(zip(prompts, params))]
    def failures() -> list[tuple[int, BaseException]]:
        return [(k, t.exception()) for k, t in enumerate(tasks) if t.done() and not t.cancelled() and t.exception() is not None]

    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if failures() and all(isinstance(err, GroupRefused) for _, err in failures()):
            await asyncio.wait(tasks)  # a refused group: every member fails at once; the refused one says why
        failed = [(k, err) for k, err in failures() if not isinstance(err, GroupRefused)] or failures()
        if failed:
            index, err = failed[0]
            if distinct > 1 and isinstance(err, APIError) and err.status == 400:  # say which prompt
                raise APIError(err.status, which_prompt(index // copies, distinct, err.message), err.param, err.code) from err
            raise err
        return [t.result() for t in tasks]
    except BaseException:
        await _close_opened(tasks)
        raise


def which_prompt(index: int, count: int, message: str) -> str:
    """``message`` about prompt ``index`` of ``count``: ``prompt 2 (of 3): ...``, without the
    ``prompt: `` the engine's message starts with when it is about the prompt (it would say
    "prompt" twice); one about another field keeps its name (``prompt 2 (of 3): max_tokens: ...``)."""
    return f"prompt {index} (of {count}): {message.removeprefix('prompt: ')}"


async def _close_opened(tasks: Sequence["asyncio.Future[tuple[Any, AsyncIterator[Any]]]"]) -> None:
    """Cancel the admissions still pending and close the streams that opened (aborting their requests)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and task.exception() is None:
            await task.result()[1].aclose()


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


async def merge_streams(streams: Sequence[tuple[Any, AsyncIterator[Any]]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several output streams as (index, output), in arrival order.

    The hand-over queue holds at most one item per stream: while the consumer (a client that
    reads slowly, or not at all) lags, the streams' outputs wait in their engine mailboxes,
    which merge them (``runtime/output_mailbox.py``) instead of piling up here, one full copy
    of each output per step. Closing this generator closes every underlying stream (aborting
    their requests).
    """
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=len(streams))
    done_marker = object()

    async def pump(index: int, first: Any, rest: AsyncIterator[Any]) -> None:
        try:
            async for item in _chain(first, rest):
                await queue.put((index, item))
            await queue.put((index, done_marker))
        except BaseException as err:  # the stream's own error (a CancelledError too): forwarded, re-raised there
            if isinstance(err, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise  # this pump's: the consumer is closing, and nobody reads the queue any more
            await queue.put((index, err))

    tasks = [asyncio.create_task(pump(i, f, r)) for i, (f, r) in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done_marker:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in (r for _, r in streams):
            await stream.aclose()


@contextlib.asynccontextmanager
async def merged(streams: Sequence[tuple[Any, AsyncIterator[Any]]]) -> AsyncIterator[AsyncIterator[tuple[int, Any]]]:
    """``merge_streams(streams)``, closed when the block ends however it ends: a ``break`` on an
    error output, a raise, or the close of the generator the block is in (a client gone). Leaving
    an ``async for`` does not close the generator it iterates, so the other choices' requests
    went on generating for nobody until the garbage collector finalised it. The streams are
    closed too, which matters when the merge never started (a client gone during chat's role chunks)."""
    outputs = merge_streams(streams)
    try:
        yield outputs
    finally:
        await outputs.aclose()
        results = await asyncio.gather(*(rest.aclose() for _, rest in streams), return_exceptions=True)
        for error in (r for r in results if isinstance(r, BaseException)):  # already closed by the merge, unless cancelled half-way
            log.warning("closing an engine stream failed: %s: %s", type(error).__name__, error)


def failure_event_body(err: Exception, request_id: str) -> dict[str, Any]:
    """The SSE error event for an exception raised while a stream was being sent (the 200 and
    earlier chunks are already out, so it can no longer be an HTTP error): an ``APIError``
    (e.g. a Ray replica that died: 503, retry) keeps its status, message and code; anything
    else is logged with its traceback and sent as a 500."""
    if isinstance(err, APIError):
        return error_body(err.status, err.message, err.param, err.code)
    log.error("%s failed while streaming: %s: %s", request_id, type(err).__name__, err, exc_info=err)
    return internal_error_body(err)


def failure_of(output: Any) -> APIError:
    """The HTTP error for an output that finished with "error": a 400 when the request's own
    parameters left nothing to sample (``error_kind`` "request"), a 503 when the server shut down
    before it finished ("shutdown", as ``/health`` then), else a 500 (the engine's side, e.g. a
    corrupted adapter file or non-finite logits)."""
    message = output.error or "the request failed in the engine"
    if output.error_kind == "request":
        return APIError(400, message, code="invalid_parameter")
    if output.error_kind == "shutdown":
        return APIError(503, message, code="engine_unavailable")
    return APIError(500, message, code="engine_error")


def raise_if_failed(output: Any) -> None:
    if output.finish_reason == "error":
        raise failure_of(output)


def finish_reason(output: Any) -> str | None:
    return output.finish_reason if output.finished else None




async def until_disconnected(
    request: Any, awaitable: Any, poll_s: float = 0.25, release: Optional[Callable[[Any], Awaitable[None]]] = None
) -> Any:
    """Await ``awaitable``; if the HTTP client goes away first, cancel it (aborting the engine request).

    ``release``: what to do with a result nobody will read, when ``awaitable`` finished just as
    the disconnect was noticed (e.g. ``close_streams`` for ``open_streams``' streams, so their
    requests are aborted now rather than whenever the garbage collector finalises them)."""
    task = asyncio.ensure_future(awaitable)
    handed_over = False
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                handed_over = True
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "client disconnected", code="client_closed_request")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif not handed_over and release is not None and not task.cancelled() and task.exception() is None:
            await release(task.result())  # it finished, but the caller is leaving without it (disconnect, cancellation)


async def close_streams(streams: Sequence[tuple[Any, AsyncIterator[Any]]]) -> None:
    """Close every one of ``open_streams``' streams (aborting their engine requests), even if one fails to close."""
    results = await asyncio.gather(*(rest.aclose() for _, rest in streams), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
