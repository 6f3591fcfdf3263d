"""POST /v1/completions: text completion, streamed (SSE) or whole."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.server import generation as gen
from runtime.server.errors import APIError, UTF8Route, error_body
from runtime.server.logprobs import StreamedEntries, TextOffsets, completion_logprobs, has_text_before, prompt_text_offsets
from runtime.server.protocol import MAX_PROMPTS, CompletionRequest
from runtime.server.sse import DONE, EventStreamResponse, event


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    """Normalise the four prompt forms to a list of prompts (at most ``MAX_PROMPTS``); the engine checks token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "prompt: must not be an empty list", param="prompt", code="invalid_parameter")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if len(p) > MAX_PROMPTS:
        raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(p)}; send several requests", param="prompt", code="invalid_parameter")
    if all(isinstance(x, str) for x in p):
        return list(p)
    for i, ids in enumerate(p):
        if not ids:  # named as the engine's refusals are (open_streams): by its index only among several prompts
            message, param = "prompt: token-id prompts must not be empty", "prompt"
            if len(p) > 1:
                message, param = gen.which_prompt(i, len(p), message), f"prompt.{i}"
            raise APIError(400, message, param=param, code="invalid_parameter")
    return [list(ids) for ids in p]


async def _params(body: CompletionRequest, prompt: str | list[int], state: Any) -> Any:
    """The prompt's SamplingParams: an explicit max_tokens as sent (the engine refuses one that
    does not fit), else the default 16 capped by the room the prompt leaves."""
    prompt_logprobs = body.logprobs if body.echo else None
    if body.max_tokens is not None:  # 0 (echo, score only): the engine computes (and scores) the prompt, generates nothing
        return gen.sampling_params(body, body.max_tokens, body.logprobs, prompt_logprobs)
    prompt_len = len(prompt) if isinstance(prompt, list) else len(await gen.encode_text(state.tokenizer, prompt))  # as the engine encodes it
    max_tokens = gen.default_max_tokens(gen.DEFAULT_COMPLETION_TOKENS, prompt_len, state.max_seq_tokens)
    return gen.sampling_params(body, max_tokens, body.logprobs, prompt_logprobs)


def _echoed(prompt: str | list[int], tokenizer: Any) -> str:
    """The prompt as ``echo`` puts it in front of the text: as sent, or decoded from token ids."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


def _prompt_logprobs(out: Any, tokenizer: Any, offsets: TextOffsets, prompt: str | list[int], echoed: str) -> dict[str, Any]:
    """The legacy logprobs object of the prompt's tokens (echo); ``offsets`` then continues
    after ``echoed``, the prompt's text in the reply.

    A text prompt is echoed as sent, so its tokens' offsets index it as sent (``prompt_text_offsets``):
    counting token texts alone would drift where it spells a special token (``<eos>``) or has
    characters the vocabulary lacks, which decoding drops. Token ids are echoed decoded, and counted."""
    starts = None
    if isinstance(prompt, str):
        ids, spans = tokenizer.encode_with_spans(prompt)
        if ids == list(out.prompt_token_ids):  # the engine's own encoding: always the same ids
            starts = prompt_text_offsets(tokenizer, prompt, ids, spans)
    head = completion_logprobs(tokenizer, out.prompt_logprobs, offsets, out.prompt_token_ids, starts)
    offsets.restart_at(len(echoed))
    return head


def _whole_logprobs(out: Any, tokenizer: Any, prompt: str | list[int], echoed: str | None) -> dict[str, Any] | None:
    """A finished choice's logprobs object: with ``echoed`` (the prompt's text, echo), the
    prompt's tokens first, then the generated ones."""
    if out.logprobs is None:
        return None
    offsets = TextOffsets(tokenizer, has_text_before(tokenizer, out.prompt_token_ids))
    if echoed is None:
        return completion_logprobs(tokenizer, out.logprobs, offsets)
    head = _prompt_logprobs(out, tokenizer, offsets, prompt, echoed)
    tail = completion_logprobs(tokenizer, out.logprobs, offsets)
    return {key: head[key] + tail[key] for key in head}


def _choice(index: int, out: Any, with_ids: bool, text: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": gen.finish_reason(out)}
    if with_ids:
        choice["prompt_token_ids"] = list(out.prompt_token_ids)
        choice["token_ids"] = list(out.token_ids)
    return choice


def _choice_usage(out: Any) -> dict[str, int]:
    """One choice's usage so far (its prompt and its tokens): continuous_usage_stats chunks."""
    return _usage({0: out})


def _usage(finals: dict[int, Any], n: int = 1) -> dict[str, int]:
    """Usage of finished choices by index; a prompt's tokens count once however many choices it has (OpenAI's rule)."""
    prompt = sum(len(o.prompt_token_ids) for k, o in finals.items() if k % n == 0)
    completion = sum(len(o.token_ids) for o in finals.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def build_router(state: Any) -> APIRouter:
    router = APIRouter(route_class=UTF8Route)

    @router.post("/v1/completions", tags=["openai"])
    async def create_completion(body: CompletionRequest, request: Request) -> Any:
        engine = state.engine
        target = gen.resolve_model(engine, state.base_name, body.model)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens: 0 generates nothing, which only makes sense with echo: true (scoring the prompt); "
                           "otherwise it must be >= 1", param="max_tokens", code="invalid_parameter")  # fmt: skip
        score_only = body.max_tokens == 0
        if score_only and body.min_tokens > 0:
            raise APIError(400, f"min_tokens: {body.min_tokens} is more than max_tokens=0", param="min_tokens", code="invalid_parameter")
        prompts = _prompts(body)
        if len(prompts) * body.n > MAX_PROMPTS:
            raise APIError(400, f"n: {len(prompts)} prompts x n={body.n} is more than {MAX_PROMPTS} choices per request; send several requests",
                           param="n", code="invalid_parameter")  # fmt: skip
        choices_in, params = gen.choices_of(prompts, [await _params(body, prompt, state) for prompt in prompts], body.n)
        request_id = gen.new_id("cmpl")
        gen.log_request(request_id, body, target)
        created = int(time.time())
        # Every choice is admitted at once; a client that goes away meanwhile aborts them all.
        streams = await gen.until_disconnected(request, gen.open_streams(engine, request_id, choices_in, params, target.adapter, copies=body.n),
                                               release=gen.close_streams)  # fmt: skip

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
            payload: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created, "model": body.model, "choices": choices}
            if usage is not None:
                payload["usage"] = usage
            return payload

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

            def stream_chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
                payload = chunk(choices, usage)
                if include_usage and usage is None:
                    payload["usage"] = None  # OpenAI: with include_usage every chunk has usage, null but in the last one
                return payload

            async def events() -> AsyncIterator[str]:
                finals: dict[int, Any] = {}
                # With logprobs, an entry waits for the chunk that carries its token's text (StreamedEntries).
                pending: dict[int, StreamedEntries] = {}
                offsets: dict[int, TextOffsets] = {}
                started: set[int] = set()
                try:
                    async with gen.merged(streams) as outputs:
                        async for index, out in outputs:
                            if out.finish_reason == "error":
                                failure = gen.failure_of(out)
                                yield event(error_body(failure.status, failure.message, code=failure.code))
                                break
                            if index not in started:  # its prompt is known now: is there text before the output?
                                before = has_text_before(state.tokenizer, out.prompt_token_ids)
                                pending[index], offsets[index] = StreamedEntries(state.tokenizer, before), TextOffsets(state.tokenizer, before)
                            if body.echo and index not in started:  # the prompt first, in a chunk of its own
                                echoed = _echoed(choices_in[index], state.tokenizer)
                                logprobs = None
                                if body.logprobs is not None:  # an entry per prompt token: a long prompt's are built off the event loop
                                    logprobs = await gen.off_loop_if_long(len(echoed), lambda: _prompt_logprobs(out, state.tokenizer, offsets[index], choices_in[index], echoed))
                                echo_choice = {"index": index, "text": echoed, "logprobs": logprobs, "finish_reason": None}
                                prompt_only = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": 0, "total_tokens": len(out.prompt_token_ids)}
                                yield event(stream_chunk([echo_choice], prompt_only if continuous else None))
                            started.add(index)
                            pending[index].add(out.new_logprobs or ())
                            if out.new_text or out.finished or (continuous and out.new_token_ids):
                                logprobs = None
                                if body.logprobs is not None:
                                    logprobs = completion_logprobs(state.tokenizer, pending[index].release(out.new_text, out.finished), offsets[index])
                                choice = _choice(index, out, body.return_token_ids and out.finished, out.new_text, logprobs)
                                yield event(stream_chunk([choice], _choice_usage(out) if continuous else None))
                            if out.finished:
                                finals[index] = out
                        else:
                            if include_usage:
                                yield event(stream_chunk([], _usage(finals, body.n)))
                except Exception as err:  # noqa: BLE001 - the response has started: an error event, then [DONE]
                    yield event(gen.failure_event_body(err, request_id))
                yield DONE

            return EventStreamResponse(events())

        async def drain() -> dict[int, Any]:
            finals: dict[int, Any] = {}
            async with gen.merged(streams) as outputs:
                async for index, out in outputs:
                    if out.finished:
                        gen.raise_if_failed(out)
                        finals[index] = out
            return finals

        finals = await gen.until_disconnected(request, drain())
        echoes = {k: _echoed(choices_in[k], state.tokenizer) if body.echo else None for k in finals}

        def whole_choices() -> list[dict[str, Any]]:
            return [_choice(k, o, body.return_token_ids, (echoes[k] or "") + o.text, _whole_logprobs(o, state.tokenizer, choices_in[k], echoes[k]))
                    for k, o in sorted(finals.items())]  # fmt: skip

        # Logprobs have an entry per token (with echo, the prompt's too): long texts' are built off the event loop.
        text_chars = sum(len(echoes[k] or "") + len(o.text) for k, o in finals.items()) if body.logprobs is not None else 0
        choices = await gen.off_loop_if_long(text_chars, whole_choices)
        return JSONResponse(chunk(choices, _usage(finals, body.n)))

    return router
