"""The ``logprobs`` objects of OpenAI's responses, from the engine's ``TokenLogprobs``.

Values are the model's own log-probabilities (``log_softmax`` of its logits, before
penalties, temperature, top-k and top-p, as vLLM reports them). Every generated token has an
entry, also one that adds no text (a special token, part of a multi-byte character, the
token that completed a stop string), matching ``usage.completion_tokens``.

Completions (legacy format), for tokens t_1..t_n of one choice (with ``echo``, the prompt's tokens
first, the first of them with null logprob and top_logprobs):
    {"tokens": [text(t_i)], "token_logprobs": [logprob(t_i)],
     "top_logprobs": [{text(j): logprob(j) for the k most likely j, and for t_i itself}] (so up to k + 1
                     entries, as OpenAI documents: the sampled token is always there),
     "text_offset": [offset of t_i]}   offset = ``start`` + the length of text(t_1..t_{i-1})
Chat: {"content": [{"token": text, "logprob": lp, "bytes": [...] or null,
                   "top_logprobs": [{"token", "logprob", "bytes"}, ...]}], "refusal": null}
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from runtime.request import TokenLogprobs


def completion_logprobs(tokenizer: Any, entries: Sequence[Optional[TokenLogprobs]], start: int = 0,
                        token_ids: Optional[Sequence[int]] = None) -> tuple[dict[str, Any], int]:  # fmt: skip
    """(the legacy ``logprobs`` object for ``entries``, the text offset after them).

    ``token_ids``: the tokens, when some entry is None (the first prompt token with ``echo``:
    nothing predicts it, so its logprob and its top_logprobs are null)."""
    ids = list(token_ids) if token_ids is not None else [e.token_id for e in entries if e is not None]
    if len(ids) != len(entries):
        raise ValueError(f"completion_logprobs: {len(entries)} entries for {len(ids)} tokens")
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = start
    for token_id, entry in zip(ids, entries):
        text = tokenizer.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(entry.logprob)
        # Two ids can share a text (a token and a special token spelled alike): keep the likelier.
        alternatives: dict[str, float] = {}
        for alt_id, logprob in entry.top:
            alternatives.setdefault(tokenizer.token_text(alt_id), logprob)
        alternatives.setdefault(text, entry.logprob)
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """The chat ``logprobs`` object for ``entries``."""
    def token(token_id: int, logprob: float) -> dict[str, Any]:
        raw: Optional[bytes] = tokenizer.token_bytes(token_id)
        return {"token": tokenizer.token_text(token_id), "logprob": logprob, "bytes": list(raw) if raw is not None else None}

    content = [{**token(e.token_id, e.logprob), "top_logprobs": [token(i, lp) for i, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}
