"""Request bodies of the OpenAI-compatible API (pydantic), so /openapi.json describes them.

Every accepted field is honoured. OpenAI fields lorafleet does not implement are
declared with their only supported value (e.g. a chat message's content
parts must be text, ``response_format`` ``{"type": "text"}``) and anything else is a 400; the
others (``UNSUPPORTED_OPENAI_FIELDS``: tool calling, ...) take null only, which OpenAI reads as
not set; unknown fields are a 400 too. Numbers are strict: a JSON
boolean is not a number (``"max_tokens": true`` is a 400, not 1), integer fields and token
ids take integers only, float fields take integers or floats, and boolean fields take
``true`` and ``false`` only (not ``"yes"``, ``"false"`` or 1). A JSON ``null`` in a field
OpenAI documents as nullable (temperature, top_p, n, the penalties, stream, echo, ...) means
that field's default, as in OpenAI's API and vLLM's.
"""
from __future__ import annotations

import re
from types import MappingProxyType
from typing import Annotated, Any, Collection, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationInfo, field_validator, model_validator

from runtime.request import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY
from runtime.server.options import ADAPTER_NAME_MAX_LEN, ADAPTER_NAME_PATTERN, ADAPTER_NAME_RULE, is_adapter_name

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # every step searches the new text for each stop string
MAX_STOP_TOKEN_IDS = 256  # every sampled token is checked against the list
MAX_PROMPTS = 256  # engine requests one HTTP request may make: prompts x n
MAX_CHOICES = 64  # n
MAX_LOGIT_BIAS_ENTRIES = 1024  # logit_bias entries: every step adds each one
# Fields where an explicit null means the default (OpenAI marks them nullable; clients such as
# LangChain send ``"temperature": null`` for "not set").
NULL_MEANS_DEFAULT = frozenset({"temperature", "top_p", "top_k", "min_p", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                                "stream", "echo", "ignore_eos", "include_stop_str_in_output", "return_token_ids", "stop", "stop_token_ids", "seed", "user",
                                "max_tokens", "max_completion_tokens", "stream_options", "logprobs", "top_logprobs", "skip_special_tokens"})
# Fields of OpenAI's API that lorafleet does not implement -> what it lacks. Null (OpenAI: not set,
# as ``message.model_dump()`` of an OpenAI client's reply sends them) is accepted and means just
# that; any other value is a 400 that names the missing feature (``errors.py``), never ignored.
UNSUPPORTED_OPENAI_FIELDS = MappingProxyType({
    "tools": "tool calling", "tool_choice": "tool calling", "parallel_tool_calls": "tool calling", "tool_calls": "tool calling",
    "functions": "function calling", "function_call": "function calling",
    "audio": "audio input or output", "modalities": "audio output", "prediction": "predicted outputs",
    "web_search_options": "web search", "reasoning_effort": "reasoning effort", "refusal": "refusal messages",
    "store": "stored completions", "metadata": "stored completions", "service_tier": "service tiers",
    "annotations": "message annotations", "suffix": "suffix (text inserted after the completion)", "best_of": "best_of (n does sampling)",
})
UNSET_BY_NULL = NULL_MEANS_DEFAULT | frozenset(UNSUPPORTED_OPENAI_FIELDS)  # a request's fields where null means: not given
LOGPROBS_HELP = ("Log-probabilities of the generated tokens under the model (log_softmax of its logits, before logit_bias, "
                 "min_tokens, penalties, temperature, min_p, top_k and top_p), one entry per generated token.")


def _valid_unicode(text: str) -> str:
    """JSON can carry a lone UTF-16 surrogate (``"\\ud800"``), which is not Unicode text: no
    tokenizer can encode it, and a log line cannot print it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"not valid Unicode text: a lone surrogate {text[err.start]!r} at character {err.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]  # a string field whose text reaches the tokenizer, a template or a log

MAX_TOKENS_HELP = ("Tokens to generate. Default: 16 for completions, all the room left for chat; both capped to what the "
                   "prompt leaves of max_model_len and of the KV pool (num_kv_blocks * block_size). An explicit value that does not fit is a 400. "
                   "0 only with echo (completions): score the prompt, generate nothing.")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = Field(False, description="Send a last chunk with token usage before [DONE].")
    continuous_usage_stats: StrictBool = Field(
        False,
        description="With include_usage: every chunk also carries its choice's usage so far, and a chunk is sent for every "
        "step that generated tokens, even when they decode to no text yet (a partial UTF-8 character, a special token), "
        "so a client can time every token.",
    )

    @field_validator("continuous_usage_stats")
    @classmethod
    def _continuous_needs_usage(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("include_usage") is False:  # not when include_usage itself is invalid (its own error)
            raise ValueError("needs stream_options.include_usage: true")
        return value


def _unset_nulls(data: Any, nullable: Collection[str]) -> Any:
    """``data`` without the keys in ``nullable`` whose value is null (it means: not set)."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if not (v is None and k in nullable)}
    return data


def _nullable_defaults(schema: dict[str, Any], model: Any = None) -> None:
    """The JSON schema says what ``_null_means_default`` does: those fields also take null."""
    for name, prop in list(schema.get("properties", {}).items()):
        allows_null = prop.get("type") == "null" or any(alt.get("type") == "null" for alt in prop.get("anyOf", []))
        if name in NULL_MEANS_DEFAULT and not allows_null:
            kept = {key: prop.pop(key) for key in ("default", "description", "title") if key in prop}
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **kept}


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_nullable_defaults)

    model: Text = Field(..., description="The base model's name, or the name of a registered adapter.")
    max_tokens: Optional[StrictInt] = Field(None, ge=0, description=MAX_TOKENS_HELP)
    temperature: float = Field(1.0, ge=0.0, le=2.0, strict=True, description="Below 1e-5 (0 included) means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, strict=True)
    top_k: StrictInt = Field(0, ge=-1, description="0 or -1 disables top-k.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, strict=True, description="vLLM's extension: after temperature, keep only the tokens "
                         "whose probability is at least min_p times the most likely token's. 0 disables it.")
    seed: Optional[StrictInt] = Field(None, ge=-(2**63), le=2**63 - 1, description="Any 64-bit signed integer, as OpenAI and vLLM "
                                      "take; the sampler uses it modulo 2**64 (two's complement: -1 seeds as 2**64 - 1).")
    stop: Optional[Union[Text, list[Text]]] = Field(None, description="Up to 16 stop strings; the text ends before the match "
                                                  "(after it with include_stop_str_in_output).")
    stop_token_ids: Optional[list[StrictInt]] = Field(None, max_length=MAX_STOP_TOKEN_IDS, description=f"Up to {MAX_STOP_TOKEN_IDS} token ids that end generation.")
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = Field(False, description="vLLM's extension: keep the stop string that ended the reply at its end; likewise the text of a stop_token_ids token that ended it (special tokens have none).")
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = Field(None, description="Only with stream: true.")
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES, description=f"Choices per prompt, 1 to {MAX_CHOICES} (each is its own engine request; "
                         "with a seed, choice j samples with seed + j). Prompts times n is at most " + str(MAX_PROMPTS) + ".")
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, strict=True,
                                    description="Subtracted from the logit of every token generated so far (once, however often it appeared).")
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, strict=True,
                                     description="Times the number of times a token was generated so far, subtracted from its logit.")
    repetition_penalty: float = Field(1.0, gt=0.0, strict=True, allow_inf_nan=False,
                                      description="vLLM's extension (1 = off): the logit z of every token of the prompt or the output "
                                      "so far becomes z / r if z > 0, else z * r. Applied before the two penalties above.")
    logit_bias: Optional[dict[str, StrictFloat]] = Field(None, description=f"Token id (as a string) -> bias in [-{MAX_LOGIT_BIAS:g}, "
                                                   f"{MAX_LOGIT_BIAS:g}] added to its logit before sampling (at most {MAX_LOGIT_BIAS_ENTRIES} entries).")
    min_tokens: StrictInt = Field(0, ge=0, description="vLLM's extension: nothing ends the reply before this many tokens (eos, "
                                  "stop_token_ids and stop strings are held back until then). At most max_tokens.")
    user: Optional[Text] = Field(None, max_length=256, description="Caller id; recorded in the access log line of the request.")
    skip_special_tokens: StrictBool = Field(True, description="vLLM's extension: special tokens are left out of the text. Only true "
                                            "(vLLM's default, what lorafleet does); false is refused.")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        return _unset_nulls(data, UNSET_BY_NULL)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_form(cls, value: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}")
        for key, bias in value.items():
            if not re.fullmatch(r"[0-9]+", key):
                raise ValueError(f"keys are token ids written as strings of digits, got {key!r}")
            if len(key.lstrip("0")) > 12:  # no vocabulary is that large; int() of a huge string is slow and refused
                raise ValueError(f"token id {key[:16]}... is larger than any vocabulary")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases are in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias} for token {key}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_bounded(cls, value: Union[str, list[str], None]) -> Union[str, list[str], None]:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        return value

    @field_validator("skip_special_tokens")
    @classmethod
    def _special_tokens_skipped(cls, value: bool) -> bool:
        if not value:
            raise ValueError("false is not supported: lorafleet's text always leaves special tokens out (true, vLLM's default)")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: Optional[StreamOptions], info: ValidationInfo) -> Optional[StreamOptions]:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("only allowed when stream is true")
        return value


class CompletionRequest(_SamplingFields):
    prompt: Union[Text, list[Text], list[StrictInt], list[list[StrictInt]]] = Field(
        ..., description=f"A string, a list of strings, a list of token ids, or a list of token-id lists (at most {MAX_PROMPTS} prompts)."
    )
    return_token_ids: StrictBool = Field(False, description="Add prompt_token_ids and token_ids to each choice.")
    echo: StrictBool = Field(False, description="Put the prompt in front of the completion; with logprobs, the prompt's tokens get "
                       "their logprobs too (the first one null: nothing predicts it).")
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS, description=LOGPROBS_HELP + " The k most likely tokens per "
                                          f"position, 0 to {MAX_LOGPROBS} (0: only the generated token's).")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, value: Any) -> Any:
        """One clear message for a prompt of none of the four forms (the union would report one per form)."""
        def token_ids(items: Any) -> bool:
            return isinstance(items, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in items)

        if isinstance(value, str) or token_ids(value):
            return value
        if isinstance(value, list) and (all(isinstance(p, str) for p in value) or all(token_ids(p) for p in value)):
            return value
        raise ValueError("expected a string, a list of strings, a list of token ids (integers), or a list of token-id lists")


class TextPart(BaseModel):
    """One part of a message's content array; only text parts are supported."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """A chat message. ``content`` is a string or an array of text parts (joined with "\\n",
    as vLLM does for text); ``developer`` (OpenAI's newer name for the system role)
    reaches the chat template as ``system``, which is the role templates know; ``name`` is
    passed to the template, which may use it or not. Only an assistant message may have null
    content (an earlier turn with no text), which reaches the tokenizer as None: it leaves the key
    out, as transformers' ``apply_chat_template`` does (``Tokenizer.apply_chat_template``)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Optional[Union[Text, list[TextPart]]]
    name: Optional[Text] = Field(None, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _unset_unsupported(cls, data: Any) -> Any:
        """An OpenAI client's reply message sent back as is (``tool_calls: null``, ``refusal: null``, ...)."""
        return _unset_nulls(data, UNSUPPORTED_OPENAI_FIELDS)

    @field_validator("content", mode="before")
    @classmethod
    def _content_form(cls, value: Any) -> Any:
        """One clear message per wrong form (the union would report one per branch)."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"part {i}: content parts of type {kind!r} are not supported; only \"text\" parts are")
            return value
        raise ValueError("expected a string, an array of text parts, or null (assistant messages only)")

    @field_validator("content")
    @classmethod
    def _content_present(cls, value: Any, info: ValidationInfo) -> Any:
        """Null content is for assistant messages only (an unknown role is reported as such)."""
        role = info.data.get("role")
        if value is None and role not in (None, "assistant"):
            raise ValueError(f"a {role} message needs content")
        return value

    def template_fields(self) -> dict[str, str | None]:
        """The message as the tokenizer takes it: role, content as one string (None when null, which the
        tokenizer leaves out), and name when given."""
        content = self.content if self.content is None or isinstance(self.content, str) else "\n".join(part.text for part in self.content)
        fields = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            fields["name"] = self.name
        return fields


class TextResponseFormat(BaseModel):
    """OpenAI's ``response_format``: only ``{"type": "text"}``, its default (plain text)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value != "text":
            raise ValueError(f"{value!r} is not supported: lorafleet does not implement JSON mode or structured output; only \"text\"")
        return value


class _ChatTemplateFields(BaseModel):
    """vLLM's fields for how the chat template renders the messages: chat completions and
    /tokenize's messages (``generation.render_chat`` checks them against the messages)."""

    model_config = ConfigDict(extra="forbid")
    add_generation_prompt: StrictBool = Field(True, description="vLLM's extension: the template's add_generation_prompt: end the "
                                              "prompt with the start of an assistant message. false: the prompt ends after the last message.")
    continue_final_message: StrictBool = Field(False, description="vLLM's extension: the prompt ends inside the last message (of "
                                               "any role), right after its content (no end of turn), so the model continues it; the reply "
                                               "holds the continuation only. Needs add_generation_prompt: false.")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description="vLLM's extension: more variables for the chat template "
                                                            "(e.g. {\"enable_thinking\": false}); one the template does not read changes "
                                                            "nothing. A special token's name (bos_token, ...) overrides it, as in transformers; "
                                                            "other names the server sets (messages, add_generation_prompt, tools, "
                                                            "documents, the template's functions) are a 400.")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_text_is_unicode(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        """Every string in it, keys included, is Unicode text (it may be written into the prompt).
        ``{}`` sets no variable, so it is None: one value for "none given"."""
        pending: list[Any] = [value]
        while pending:
            item = pending.pop()
            if isinstance(item, dict):
                pending.extend(item.keys())
                pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)
            elif isinstance(item, str):
                _valid_unicode(item)
        return value or None


CHAT_TEMPLATE_FIELDS = tuple(_ChatTemplateFields.model_fields)


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    response_format: Optional[TextResponseFormat] = Field(None, description='Only {"type": "text"}, OpenAI\'s default: lorafleet '
                                                          "has no JSON mode or structured output.")
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1, description="OpenAI's current name for max_tokens in chat; "
                                                       "give one of the two (both only if equal).")
    return_token_ids: StrictBool = False
    logprobs: StrictBool = Field(False, description=LOGPROBS_HELP)
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS, description=f"With logprobs: true, the 0 to {MAX_LOGPROBS} most "
                                              "likely tokens at each position (default 0).")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("needs logprobs: true")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_token_limit(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        other = info.data.get("max_tokens")
        if value is not None and other is not None and other != value:
            raise ValueError(f"{value} differs from max_tokens ({other}); send one of them")
        return value

    @model_validator(mode="after")
    def _max_completion_tokens_is_max_tokens(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(..., min_length=1, max_length=ADAPTER_NAME_MAX_LEN, pattern=ADAPTER_NAME_PATTERN)
    lora_path: str = Field(..., min_length=1, max_length=4096)

    @field_validator("lora_name", mode="before")
    @classmethod
    def _name_rule(cls, value: Any) -> Any:
        """The name rule in words (``ADAPTER_NAME_RULE``, as --lora-modules says it), before the
        Field's constraints (kept for /openapi.json) could answer with the bare pattern."""
        if isinstance(value, str) and not is_adapter_name(value):
            raise ValueError(f"must be {ADAPTER_NAME_RULE}")
        return value


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(..., min_length=1, max_length=ADAPTER_NAME_MAX_LEN)


class TokenizeRequest(_ChatTemplateFields):
    """vLLM's ``POST /tokenize``: a ``prompt`` (as completions encodes it) or chat ``messages``
    (as chat completions renders and encodes them, with the same chat template fields), so
    ``count`` equals that route's ``usage.prompt_tokens``."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[Text] = Field(None, description="The base model or an adapter (they share the tokenizer); default the base.")
    prompt: Optional[Text] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Optional[StrictBool] = Field(None, description="Default: true for a prompt (as completions), false for messages "
                                               "(the chat template writes its own special tokens, as chat completions).")
    return_token_strs: StrictBool = Field(False, description="Also return each token's text.")



class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[Text] = None
    tokens: list[StrictInt] = Field(..., description="Token ids to decode (special tokens are skipped, as in generated text).")
