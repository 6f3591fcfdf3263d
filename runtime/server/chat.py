"""POST /v1/chat/completions: the checkpoint's chat template (or the documented default) + completion."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.chat_template_sizes import size_cap
from runtime.server import generation as gen
from runtime.server.errors import APIError, UTF8Route, error_body
from runtime.server.logprobs import StreamedEntries, chat_logprobs, has_text_before
from runtime.server.protocol import ChatCompletionRequest
from runtime.server.sse import DONE, EventStreamResponse, event


def _as_sent(err: APIError, body: ChatCompletionRequest) -> APIError:
    """``err`` naming ``max_completion_tokens`` where it says ``max_tokens``, when that is the name
    the client sent (the request model copies it into ``max_tokens``)."""
    if "max_completion_tokens" not in body.model_fields_set or "max_tokens" not in (err.message + str(err.param)):
        return err
    param = "max_completion_tokens" if err.param == "max_tokens" else err.param
    return APIError(err.status, err.message.replace("max_tokens", "max_completion_tokens"), param, err.code)


def build_router(state: Any) -> APIRouter:
    router = APIRouter(route_class=UTF8Route)

    @router.post("/v1/chat/completions", tags=["openai"])
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
        engine = state.engine
        target = gen.resolve_model(engine, state.base_name, body.model)
        if body.max_tokens == 0:
            raise APIError(400, "max_tokens: must be >= 1 (0, scoring a prompt, is for completions with echo)", param="max_tokens",
                           code="invalid_parameter")  # fmt: skip
        prompt = await gen.render_chat_off_loop(state.chat_renders, state.tokenizer, body, size_cap(state.options.max_request_bytes))
        # The template writes the special tokens it wants (e.g. ``{{ bos_token }}``) as text; encoding
        # with special tokens added would put a second BOS in front (as HF and vLLM, encode without).
        prompt_ids = await gen.encode_text(state.tokenizer, prompt, add_special_tokens=False)
        prompt_len = len(prompt_ids)
        # Default: whatever room the context (and the KV pool: max_seq_tokens) has left, as vLLM does for chat.
        max_tokens = body.max_tokens if body.max_tokens is not None else gen.default_max_tokens(state.max_seq_tokens, prompt_len, state.max_seq_tokens)
        request_id = gen.new_id("chatcmpl")
        created = int(time.time())
        try:
            params = gen.sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
            gen.log_request(request_id, body, target)
            # Admission waits for the first token (queue + prefill): a client that leaves meanwhile aborts it.
            choices_in, choice_params = gen.choices_of([prompt_ids], [params], body.n)
            streams = await gen.until_disconnected(request, gen.open_streams(engine, request_id, choices_in, choice_params, target.adapter,
                                                                              prompt_param="messages", copies=body.n), release=gen.close_streams)  # fmt: skip
        except APIError as err:
            raise _as_sent(err, body) from err

        def payload(obj: str, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
            out: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": body.model, "choices": choices}
            if usage is not None:
                out["usage"] = usage
            return out

        def usage(finals: list[Any]) -> dict[str, int]:
            """The prompt counts once however many choices share it (OpenAI's rule)."""
            p, c = (len(finals[0].prompt_token_ids) if finals else 0), sum(len(o.token_ids) for o in finals)
            return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

        def with_ids(choice: dict[str, Any], out: Any) -> dict[str, Any]:
            if body.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = list(out.prompt_token_ids), list(out.token_ids)
            return choice

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

            def stream_chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
                out = payload("chat.completion.chunk", choices, usage)
                if include_usage and usage is None:
                    out["usage"] = None  # OpenAI: with include_usage every chunk has usage, null but in the last one
                return out

            async def events() -> AsyncIterator[str]:
                prompt_only = {"prompt_tokens": prompt_len, "completion_tokens": 0, "total_tokens": prompt_len}  # the role chunks' usage (vLLM)
                last: dict[int, Any] = {}
                before = has_text_before(state.tokenizer, prompt_ids)
                pending = {k: StreamedEntries(state.tokenizer, before) for k in range(body.n)}  # an entry waits for its token's text
                try:
                    async with gen.merged(streams) as outputs:  # entered first: a client gone during the role chunks closes the streams too
                        for k in range(body.n):
                            role = {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                            yield event(stream_chunk([role], prompt_only if continuous else None))
                        async for k, out in outputs:
                            if out.finish_reason == "error":
                                failure = gen.failure_of(out)
                                yield event(error_body(failure.status, failure.message, code=failure.code))
                                break
                            pending[k].add(out.new_logprobs or ())
                            if out.new_text or out.finished or (continuous and out.new_token_ids):
                                delta = {"content": out.new_text} if out.new_text else {}
                                released = pending[k].release(out.new_text, out.finished)
                                logprobs = chat_logprobs(state.tokenizer, released) if body.logprobs else None
                                choice: dict[str, Any] = {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": gen.finish_reason(out)}
                                if out.finished:
                                    with_ids(choice, out)
                                yield event(stream_chunk([choice], usage([out]) if continuous else None))
                            last[k] = out
                        else:
                            if include_usage and last:
                                yield event(stream_chunk([], usage(list(last.values()))))
                except Exception as err:  # noqa: BLE001 - the response has started: an error event, then [DONE]
                    yield event(gen.failure_event_body(err, request_id))
                yield DONE

            return EventStreamResponse(events())

        async def drain() -> list[Any]:
            finals: dict[int, Any] = {}
            async with gen.merged(streams) as outputs:
                async for k, out in outputs:
                    if out.finished:
                        gen.raise_if_failed(out)
                        finals[k] = out
            return [finals[k] for k in range(body.n)]

        finals = await gen.until_disconnected(request, drain())

        def whole_choices() -> list[dict[str, Any]]:
            choices = []
            for k, final in enumerate(finals):
                logprobs = chat_logprobs(state.tokenizer, final.logprobs) if final.logprobs is not None else None
                choices.append(with_ids({"index": k, "message": {"role": "assistant", "content": final.text}, "logprobs": logprobs,
                                         "finish_reason": final.finish_reason}, final))  # fmt: skip
            return choices

        # Logprobs have an entry per token (and up to 20 alternatives each): long texts' are built off the event loop.
        choices = await gen.off_loop_if_long(sum(len(f.text) for f in finals) if body.logprobs else 0, whole_choices)
        return JSONResponse(payload("chat.completion", choices, usage(finals)))

    return router
