"""The ``logprobs`` objects of OpenAI's responses, from the engine's ``TokenLogprobs``.

Values are the model's own log-probabilities (``log_softmax`` of its logits, before
penalties, temperature, top-k and top-p, as vLLM reports them). Every generated token has an
entry, also one that adds no text (a special token, part of a multi-byte character, a
token whose text a stop string cut off), matching ``usage.completion_tokens``.

Completions (legacy format), for tokens t_1..t_n of one choice (with ``echo``, the prompt's tokens
first, the first of them with null logprob and top_logprobs):
    {"tokens": [text(t_i)], "token_logprobs": [logprob(t_i)],
     "top_logprobs": [{text(j): logprob(j) for the k most likely j, and for t_i itself}] (so up to k + 1
                     entries, as OpenAI documents: the sampled token is always there),
     "text_offset": [offset of t_i]}   the characters of ``text`` before t_i (``TextOffsets``)
Chat: {"content": [{"token": text, "logprob": lp, "bytes": [...] or null,
                   "top_logprobs": [{"token", "logprob", "bytes"}, ...]}], "refusal": null}
"""
from __future__ import annotations

import codecs
from typing import Any, Optional, Sequence

from runtime.detokenizer import prompt_context
from runtime.request import TokenLogprobs


class TextOffsets:
    """Where each token starts in a choice's ``text``: the characters of text before it.

    Each token's bytes (``Tokenizer.token_bytes``; none for a special token, which the text
    leaves out) go through an incremental UTF-8 decoder, so a character split over several
    tokens counts once and all its tokens start where it starts. One per choice, fed in order,
    across streamed chunks; ``restart_at`` after an echoed prompt, whose text is the prompt as sent.
    """

    def __init__(self, tokenizer: Any, text_before: bool = True) -> None:
        """``text_before``: the text is decoded to the right of some prompt text (``has_text_before``).
        Without it, a SentencePiece (Metaspace) or Strip decoder drops the leading space of the
        first token that has text, which is then not counted either."""
        self._tokenizer = tokenizer
        self._text_before = text_before
        self.restart_at(0)

    def restart_at(self, position: int) -> None:
        """Count on from ``position`` (after an echoed prompt: the output's own tokens follow)."""
        self.position = position
        self._first_text = not self._text_before  # the next token with text may lose its leading space
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def in_character(self) -> bool:
        """The tokens so far end inside a character (bytes of it are waiting for the rest)."""
        return bool(self._utf8.getstate()[0])

    def advance(self, token_id: int) -> int:
        """The offset of ``token_id``, the next token; moves past it.

        Bytes left waiting by earlier tokens that this token does not continue (its first byte
        cannot come next in a UTF-8 character: no continuation byte, or one out of the lead
        byte's range, as after E0, ED, F0 and F4) were no character: they come out now as U+FFFD,
        ahead of this token's own text, which therefore starts after them."""
        if self._tokenizer.is_special(token_id):
            return self.position
        raw = self._tokenizer.token_bytes(token_id)
        if raw is None:
            raw = self._tokenizer.token_text(token_id).encode("utf-8")
        waiting = self._utf8.getstate()[0]
        if waiting and raw and not _continues(waiting, raw[0]):
            self.position += len(self._utf8.decode(b"", final=True))  # the waiting bytes' U+FFFD
            self._utf8.reset()
            self._first_text = False
        offset = self.position
        text = self._utf8.decode(raw)
        if self._first_text and text:
            self._first_text = False
            if text.startswith(" ") and not self._tokenizer.decode([token_id], skip_special_tokens=True).startswith(" "):
                text = text[1:]  # the decoder drops it at the start of a decode, as the output's text does
        self.position += len(text)
        return offset


# The bytes that may follow a lead byte in well-formed UTF-8 (Unicode's table 3-7), where not 80-BF.
SECOND_BYTE_RANGES = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _continues(waiting: bytes, byte: int) -> bool:
    """``byte`` can follow the bytes of an unfinished UTF-8 character: E0 takes A0-BF next, ED 80-9F
    (A0-BF would start a surrogate), F0 90-BF, F4 80-8F, any other lead byte and any later byte
    80-BF, as the tokenizer's decoder (Rust's ``from_utf8_lossy``: one U+FFFD per maximal invalid
    part) judges it. Python's incremental decoder would hold ED A0-BF until the next byte;
    ``TextOffsets.advance`` puts the ED out as U+FFFD first."""
    low, high = SECOND_BYTE_RANGES.get(waiting[0], (0x80, 0xBF)) if len(waiting) == 1 else (0x80, 0xBF)
    return low <= byte <= high


def has_text_before(tokenizer: Any, prompt_ids: Sequence[int]) -> bool:
    """Whether a request's output is decoded to the right of prompt text: the detokenizer's
    context (``prompt_context``) decodes to some text. Not so for a prompt of special tokens
    only (a bos for ``""``), or one that ends inside a character; ``TextOffsets`` then drops
    the leading space that SentencePiece decoders drop."""
    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return bool(decode(prompt_context(decode, prompt_ids)))


def prompt_text_offsets(tokenizer: Any, prompt: str, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[int]:
    """Where each token of a text prompt starts in the prompt as sent (``echo`` puts it in the reply
    unchanged), from its ids and the tokenizer's spans (``Tokenizer.encode_with_spans``).

    Counted, as for generated text, while a token's text is what the prompt has there; where it is
    not, the tokenizer's span places the token and counting goes on after it: a special token
    spelled in the prompt (``<eos>`` typed as text, which decoding would drop), a token for
    characters the vocabulary lacks (``<unk>``), the bytes of a split character, a SentencePiece
    piece whose leading space the prompt does not have. Spans alone would not do: a ByteLevel
    post-processor with ``trim_offsets`` starts ``" world"`` at the ``w``. A token with an empty span
    (a bos the tokenizer added) takes no room."""
    counted = TextOffsets(tokenizer)
    starts = []
    for token_id, (start, end) in zip(ids, spans):
        here, text = counted.position, tokenizer.token_text(token_id)
        added = start == end and tokenizer.is_special(token_id)  # a bos the tokenizer put first: it spells nothing, even "<s>"
        if not added and text and "\ufffd" not in text and not counted.in_character and prompt.startswith(text, here):
            starts.append(here)
            counted.restart_at(here + len(text))
        elif start < end:
            starts.append(start)
            counted.restart_at(end)
        else:
            starts.append(here)
    return starts


class StreamedEntries:
    """One streamed choice's logprob entries, each sent with the chunk that carries the end of its
    token's text, never before.

    The text of a chunk can trail its tokens: a stop string holds back text that may be its start,
    and a character split over tokens shows once complete. An entry waits until the text sent so
    far reaches the end of its token's text (``TextOffsets`` over the generated tokens): the tokens
    of a split character end where the character does; a special token, which adds no text, goes
    with the first chunk at or past where it stands. The last chunk of the choice takes every entry
    left (those of the tokens a stop string cut off, whose text is never sent, among them)."""

    def __init__(self, tokenizer: Any, text_before: bool = True) -> None:
        self._ends = TextOffsets(tokenizer, text_before)
        self._waiting: list[tuple[Optional[int], TokenLogprobs]] = []  # (where its text ends, None: inside a character; entry)
        self._sent = 0  # characters of generated text sent so far

    def add(self, entries: Sequence[TokenLogprobs]) -> None:
        for entry in entries:
            self._ends.advance(entry.token_id)
            if self._ends.in_character:
                self._waiting.append((None, entry))
                continue
            # The character is complete: its earlier tokens end where it does.
            for i in range(len(self._waiting) - 1, -1, -1):
                if self._waiting[i][0] is not None:
                    break
                self._waiting[i] = (self._ends.position, self._waiting[i][1])
            self._waiting.append((self._ends.position, entry))

    def release(self, new_text: str, finished: bool) -> list[TokenLogprobs]:
        """The entries to send with a chunk of ``new_text`` (the choice's last chunk when ``finished``)."""
        self._sent += len(new_text)
        n = len(self._waiting)
        if not finished:
            n = next((i for i, (end, _) in enumerate(self._waiting) if end is None or end > self._sent), n)
        released = [entry for _, entry in self._waiting[:n]]
        del self._waiting[:n]
        return released


def completion_logprobs(tokenizer: Any, entries: Sequence[Optional[TokenLogprobs]], offsets: TextOffsets,
                        token_ids: Optional[Sequence[int]] = None, starts: Optional[Sequence[int]] = None) -> dict[str, Any]:  # fmt: skip
    """The legacy ``logprobs`` object for ``entries``, their ``text_offset`` from ``offsets``, or
    ``starts`` when given (a prompt echoed as sent: where the tokenizer found each token in it).

    ``token_ids``: the tokens, when some entry is None (the first prompt token with ``echo``:
    nothing predicts it, so its logprob and its top_logprobs are null)."""
    ids = list(token_ids) if token_ids is not None else [e.token_id for e in entries if e is not None]
    if len(ids) != len(entries) or (starts is not None and len(starts) != len(ids)):
        raise ValueError(f"completion_logprobs: {len(entries)} entries for {len(ids)} tokens" + (f" and {len(starts)} starts" if starts is not None else ""))
    tokens, token_logprobs, top, text_offsets = [], [], [], []
    for i, (token_id, entry) in enumerate(zip(ids, entries)):
        text = tokenizer.token_text(token_id)
        tokens.append(text)
        text_offsets.append(offsets.advance(token_id) if starts is None else starts[i])
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
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offsets}


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """The chat ``logprobs`` object for ``entries``."""
    def token(token_id: int, logprob: float) -> dict[str, Any]:
        raw: Optional[bytes] = tokenizer.token_bytes(token_id)
        return {"token": tokenizer.token_text(token_id), "logprob": logprob, "bytes": list(raw) if raw is not None else None}

    content = [{**token(e.token_id, e.logprob), "top_logprobs": [token(i, lp) for i, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}
