"""Requests: sampling parameters, adapter identity, outputs, and the errors ``add_request`` raises.

A request is bound, at arrival, to one immutable ``AdapterRef(name, version)`` (or to
no adapter). It keeps that binding for its whole life, also across a hot update of
the name, so it always finishes on the weights it started with.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal, Optional

FinishReason = Literal["stop", "length", "abort", "error"]
# Why a request finished with "error": "request" when its own parameters left nothing to do (a
# client's mistake, e.g. min_tokens and penalties that ban every token); "engine" otherwise
# (the model's logits, the adapter's files, an engine failure).
ErrorKind = Literal["engine", "request", "shutdown"]  # whose side failed: the engine, the request's own parameters, or a server shutting down


class UnknownAdapterError(ValueError):
    """The request (or an admin call) names an adapter that is not registered."""


class PromptTooLongError(ValueError):
    """The prompt, or prompt + max_tokens, exceeds the model's maximum length."""


class RequestRejected(ValueError):
    """The request can never be served by this engine (e.g. it needs more KV blocks than the pool has)."""


@dataclass(frozen=True)
class AdapterRef:
    """Immutable adapter identity: the registered name and the content hash of its weights + config."""

    name: str
    version: str

    def __post_init__(self) -> None:
        # Hashed once: the scheduler and the pool key dicts by it thousands of times a step when
        # hundreds of adapters wait (the generated __hash__ rebuilds and hashes a tuple each call).
        object.__setattr__(self, "_hash", hash((self.name, self.version)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined, no-any-return]

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Rebuilt through __init__ when pickled (Ray), so the hash is the receiving process's own:
        # str hashes differ between processes.
        return (AdapterRef, (self.name, self.version))

    def __str__(self) -> str:
        return f"{self.name}@{self.version[:12]}"


GREEDY_BELOW = 1e-5  # temperatures below this are greedy (SamplingParams.greedy)
MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs limit)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # |bias| (OpenAI's range)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Lists are stored as tuples, numpy scalars as the Python
    ints and floats they equal; anything else out of range is a ValueError naming the field.

    temperature: below ``GREEDY_BELOW`` (1e-5; 0 included) means greedy (argmax): dividing
                 float32 logits by a smaller one overflows or divides by zero (vLLM draws the same
                 line); otherwise sample from softmax(logits / temperature). The default, 0, is
                 greedy: vLLM's SamplingParams and the HTTP API default to 1 (sampling).
    top_k:       keep only the k most likely tokens, and any tied with the k-th (vLLM's and
                 transformers'; 0 = off; -1, vLLM's and the server's other spelling of off, is
                 stored as 0).
    min_p:       in [0, 1] (vLLM's; 0 = off): after temperature, keep only the tokens whose
                 probability is at least min_p times the most likely token's.
    top_p:       keep the smallest set of most likely tokens whose probability mass is >= top_p.
    seed:        seeds this request's own torch.Generator (None: drawn from the engine's seed).
    stop:        strings that end generation; the returned text is cut before the stop string
                 (after it with ``include_stop_str_in_output``, vLLM's).
    stop_token_ids: token ids that end generation (finish_reason "stop"); the token's text is left
                 out unless ``include_stop_str_in_output``.
    ignore_eos:  keep generating past the tokenizer's eos tokens.
    max_tokens:  most new tokens (finish_reason "length" when reached); 0 computes the prompt
                 and generates nothing (with ``prompt_logprobs``: scores the prompt), and the
                 prompt may then fill max_model_len.
    presence_penalty, frequency_penalty: in [-2, 2] (OpenAI's); with c_j the count of token j
                 among the tokens generated so far, the logits become
                 ``z_j - frequency_penalty * c_j - presence_penalty * [c_j > 0]``.
    repetition_penalty: > 0 (vLLM's and transformers'; 1 = off); for every token j in the
                 prompt or the output so far, ``z_j / r`` where ``z_j > 0``, else ``z_j * r``.
                 Applied before the two above; all penalties apply before temperature, min-p,
                 top-k and top-p, and to greedy decoding too (the argmax of the penalised logits).
    logprobs:    None = off; k in 0..20: each generated token comes with its log-probability
                 under the model and the k most likely tokens with theirs
                 (``RequestOutput.logprobs``), from ``log_softmax`` of the model's logits
                 before logit_bias, min_tokens, penalties, temperature, min-p, top-k and top-p (vLLM's default).
    logit_bias:  (token id, bias) pairs (a dict is accepted), bias in [-100, 100] (OpenAI's): added
                 to those logits first, before the penalties; -100 all but bans a token.
    min_tokens:  nothing ends the request before this many tokens (vLLM's): eos (unless
                 ignore_eos) and ``stop_token_ids`` get -inf logits until then, and stop strings
                 are looked for only from the token that reaches it on, and only those that end
                 in its text or later (one may start before it), as in vLLM.
    prompt_logprobs: None = off; k in 0..20: the same for every prompt token after the first
                 (``RequestOutput.prompt_logprobs``: what the model, with this request's adapter,
                 gave each prompt token given the ones before it). Such a request computes its
                 whole prompt: it reuses no prefix-cache blocks (it publishes its own).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Accept lists for convenience but store tuples, so the object stays hashable and immutable;
        # and numpy's scalars (np.int64, np.float32, ...) as the Python numbers they equal.
        for name in _INT_FIELDS:
            object.__setattr__(self, name, _plain_int(getattr(self, name)))
        for name in _FLOAT_FIELDS:
            object.__setattr__(self, name, _plain_float(getattr(self, name)))
        if type(self.top_k) is int and self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = list(bias.items())
        if isinstance(bias, (list, tuple)):  # anything malformed stays as it is, for validate() to name
            bias = tuple((_plain_int(p[0]), _plain_float(p[1])) if isinstance(p, (list, tuple)) and len(p) == 2 else p for p in bias)
            if all(isinstance(p, tuple) and type(p[0]) is int for p in bias):
                bias = tuple(sorted(bias))  # one order for one mapping: equal SamplingParams compare and hash equal
            object.__setattr__(self, "logit_bias", bias)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, (list, tuple)):
            object.__setattr__(self, "stop_token_ids", tuple(_plain_int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens: must be an integer >= 0 (0: the prompt only), got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: must be an integer >= 0, or -1 (0 and -1 = off), got {self.top_k!r}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p: must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed: must be an integer in [0, 2**64) (a torch.Generator seed) or None, got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids: must be a list of non-negative integers, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or abs(value) > MAX_PENALTY:
                raise ValueError(f"{name}: must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not _is_number(self.repetition_penalty) or not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty: must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, tuple) or not all(
            isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int) and not isinstance(pair[0], bool) and pair[0] >= 0
            and _is_number(pair[1]) and math.isfinite(pair[1]) and abs(pair[1]) <= MAX_LOGIT_BIAS
            for pair in self.logit_bias
        ):
            raise ValueError(f"logit_bias: must map non-negative token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {self.logit_bias!r:.200}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias: a token id appears twice")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}: must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Some penalty changes the logits (it needs the request's tokens so far)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """The sampler changes this request's logits before picking (bias, min_tokens or a penalty)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.penalized


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability under the model, and the most likely tokens.

    ``logprob = log_softmax(z)[token_id]`` for the step's float32 logits z (before logit_bias,
    min_tokens, penalties, temperature, min-p, top-k and top-p); ``top``: the ``SamplingParams.logprobs`` largest entries of
    ``log_softmax(z)`` as (token id, logprob), most likely first (it may or may not contain
    ``token_id``; a sampled token need not be among them).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_INT_FIELDS = ("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "min_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _plain_int(value: object) -> object:
    """An integer of another type (numpy's) as the int it equals; anything else unchanged."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


def _plain_float(value: object) -> object:
    """A real number of another type (numpy's float32, an integer one) as the float it equals; anything else unchanged."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        return float(value)
    return value


@dataclass(frozen=True)
class RequestOutput:
    """One incremental update of a request.

    new_token_ids / new_text: what this step added; token_ids / text: everything so far.
    ``text`` never contains a stop string (unless ``include_stop_str_in_output``: then it ends
    with the one that stopped it) or anything after it; while a request with stop strings
    runs, the last ``len(longest stop) - 1`` characters are held back so a streamed prefix of a
    stop string is never emitted and then retracted (nothing with ``include_stop_str_in_output``).
    """

    request_id: str
    adapter: Optional[AdapterRef]
    new_token_ids: tuple[int, ...]
    new_text: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: Optional[FinishReason]
    error: Optional[str]
    prompt_token_ids: tuple[int, ...]
    # One per entry of token_ids; None unless asked for. A tuple from the engine; a read-only view at a Ray ingress.
    logprobs: Optional[Seq[TokenLogprobs]] = None
    # One per prompt token, None for the first (nothing predicts it); None unless asked for.
    prompt_logprobs: Optional[tuple[Optional[TokenLogprobs], ...]] = None
    error_kind: Optional[ErrorKind] = None  # with finish_reason "error"

    @property
    def new_logprobs(self) -> Optional[Seq[TokenLogprobs]]:
        """The entries of ``logprobs`` for ``new_token_ids`` (None unless asked for)."""
        if self.logprobs is None:
            return None
        return self.logprobs[len(self.token_ids) - len(self.new_token_ids) :]


@dataclass(eq=False)
class Sequence:
    """Engine-internal state of one request (prompt + generated tokens, KV progress, timings).

    ``num_computed`` counts the leading tokens of ``all_token_ids`` whose KV is in the cache.
    The tokens still to run are ``all_token_ids[num_computed:]``; a decode step is the
    case where only the last sampled token is left. Preemption by recompute resets
    ``num_computed`` to 0 and keeps the generated tokens, which are prefilled again.
    """

    request_id: str
    arrival_index: int  # monotone admission order; "newest" = largest
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: Optional[AdapterRef]
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # aligned with output_token_ids when params.logprobs is set
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.. when params.prompt_logprobs is set
    num_computed: int = 0
    preemptions: int = 0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    finish_reason: Optional[FinishReason] = None
    error: Optional[str] = None
    error_kind: Optional[ErrorKind] = None
    adapter_location: str = "none"  # "device" | "host" | "disk" at arrival, "none" without adapter
    adapter_ready_time: Optional[float] = None  # when its adapter was first on the host or device

    @property
    def wants_prompt_logits(self) -> bool:
        """Prompt logprobs are asked for and not all collected yet (a recompute after preemption needs none)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` (0 <= start <= end) without building the whole list first: the
        engine takes each step's chunk this way, where the concatenation cost ~70 us per sequence at
        30k tokens, every step."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
