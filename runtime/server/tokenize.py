"""POST /tokenize and /detokenize (vLLM's routes): the served tokenizer, without running the model.

``/tokenize`` encodes a prompt exactly as ``/v1/completions`` does, or chat messages exactly as
``/v1/chat/completions`` renders and encodes them, so ``count`` is what that route reports as
``usage.prompt_tokens``; ``max_model_len`` says how much room a request has.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from runtime.chat_template_sizes import size_cap
from runtime.server import generation as gen
from runtime.server.errors import APIError, UTF8Route
from runtime.server.protocol import CHAT_TEMPLATE_FIELDS, DetokenizeRequest, TokenizeRequest


def build_router(state: Any) -> APIRouter:
    router = APIRouter(route_class=UTF8Route)

    def check_model(model: str | None) -> None:
        if model is not None:
            gen.resolve_model(state.engine, state.base_name, model)  # 404 for a name that is not served

    @router.post("/tokenize", tags=["tokenizer"])
    async def tokenize(body: TokenizeRequest) -> Any:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give either prompt or messages", param="prompt", code="invalid_parameter")
        tokenizer = state.tokenizer
        # A chat template field at its default (null or {} kwargs included, as clients send unset fields) asks for nothing.
        if body.messages is None and (given := [f for f in CHAT_TEMPLATE_FIELDS if getattr(body, f) != TokenizeRequest.model_fields[f].default]):
            raise APIError(400, f"{given[0]}: only with messages (it is how the chat template renders them)", param=given[0],
                           code="invalid_parameter")  # fmt: skip
        if body.messages is not None:
            text = await gen.render_chat_off_loop(state.chat_renders, tokenizer, body, size_cap(state.options.max_request_bytes))
            ids = await gen.encode_text(tokenizer, text, add_special_tokens=bool(body.add_special_tokens))
        else:
            ids = await gen.encode_text(tokenizer, body.prompt, add_special_tokens=body.add_special_tokens is not False)
        reply: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if body.return_token_strs:
            reply["token_strs"] = await gen.off_loop_if_long(len(ids), lambda: [tokenizer.token_text(t) for t in ids])
        return reply

    @router.post("/detokenize", tags=["tokenizer"])
    async def detokenize(body: DetokenizeRequest) -> Any:
        check_model(body.model)
        vocab = state.tokenizer.vocab_size
        outside = [t for t in body.tokens if not 0 <= t < vocab]
        if outside:
            raise APIError(400, f"tokens: ids {outside[:4]} are outside the tokenizer's vocabulary (size {vocab})", param="tokens",
                           code="invalid_parameter")  # fmt: skip
        return {"prompt": state.tokenizer.decode(body.tokens)}

    return router
