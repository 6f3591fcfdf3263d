"""Incremental detokenization with stop strings.

Byte-level BPE tokens do not map one-to-one to characters: a character may span two
tokens, and a token's text depends on its left neighbour (leading spaces). So text is
never decoded token by token. Instead (the scheme vLLM uses) two offsets into the
token list are kept, ``prefix`` <= ``read``:

    prefix_text = decode(ids[prefix:read])      (already emitted, used as left context)
    full_text   = decode(ids[prefix:])
    delta       = full_text[len(prefix_text):]  unless full_text ends in U+FFFD
                                                 (an incomplete UTF-8 sequence: wait)

Prompt context: the last ``PROMPT_CONTEXT_TOKENS`` prompt ids start the token list, with
``prefix = 0`` and ``read`` just after them, so the first output tokens are decoded to the
right of the prompt's text (as vLLM does). SentencePiece / Metaspace decoders drop the
leading space of the first token of a decode call: without context the completion " Paris"
after "The capital of France is" would come back as "Paris". With context the text is
``decode(prompt + output)[len(decode(prompt)):]``, the standard definition. The window
starts on a whole character: when its first tokens are the tail of one (byte-fallback
pieces ``<0xHH>``, which decode as one run, so the whole run, last character included,
would read as U+FFFD), it reaches back up to ``MAX_CONTINUATION_BYTES`` more tokens, and
failing that starts after them. A context whose text ends in U+FFFD (the prompt ends inside
a multi-byte character) is not used, as its partial character would swallow the output's
first character. Byte-level BPE decoding concatenates bytes, so its text is the same with or
without context.

Stop strings: the whole text is searched from ``len(text) - len(stop) + 1`` of the
previous text, so a stop string split over two deltas is found. The text is cut right
before the first stop string, or right after it with ``include_stop`` (vLLM's
``include_stop_str_in_output``). While the text waits for the rest of a character, the whole
characters before it (``full_text`` less its trailing U+FFFD) are searched too, so a stop string
ends generation at the token that completes it, also when that token carries the first bytes of
the next character (a byte-level BPE token such as ``.âĢ``, the bytes ``.\\xe2\\x80`` of ``.”``).
The earliest match wins, then the longest of the matches that start at the same place and are
complete by then. With ``min_tokens`` (vLLM's), stop strings are looked for only from the token
that reaches it on, and only those that end in its text or later (each stop string ``s`` from
``len(s) - 1`` characters before that text, as vLLM does). While running, the last
``len(longest stop) - 1`` characters are held back from the emitted text, because they could be the start of a
stop string that a later token completes. With ``include_stop`` nothing is held back (as in
vLLM): a stop string found in the text of a new token ends after the text searched before it,
so the cut, right after the stop string, never falls inside text already handed out.
"""
from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
MAX_CONTINUATION_BYTES = 3  # a UTF-8 character is one lead byte and at most three more


def prompt_context(decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int]) -> list[int]:
    """The prompt's last ``PROMPT_CONTEXT_TOKENS`` ids, moved to start on a whole character, or
    [] when the prompt ends inside one (see the module docstring)."""
    context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
    text = decode(context) if context else ""
    if text.startswith(REPLACEMENT_CHAR):
        wider = (list(prompt_ids[-(PROMPT_CONTEXT_TOKENS + extra) :]) for extra in range(1, MAX_CONTINUATION_BYTES + 1))
        narrower = (context[drop:] for drop in range(1, len(context)))
        # A prompt that itself starts with U+FFFD (or is no valid UTF-8) keeps the plain window.
        for ids in (*wider, *narrower):
            ids_text = decode(ids)
            if not ids_text.startswith(REPLACEMENT_CHAR):
                context, text = ids, ids_text
                break
    return [] if text.endswith(REPLACEMENT_CHAR) else context


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas; finds stop strings.

    ``add_tokens`` / ``finish_pending`` take the output ids only; the prompt's tail, given
    here as ``prompt_ids``, is kept in front of them as decoding context.
    """

    def __init__(
        self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), prompt_ids: Sequence[int] = (), include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._hold = 0 if include_stop else max((len(s) for s in self._stop), default=1) - 1
        context = prompt_context(decode, prompt_ids)
        self._context = context
        # Offsets index context + output ids.
        self._prefix = 0
        self._read = len(context)
        self.text = ""  # all text decoded so far (cut at a stop string once found)
        self._emitted = 0  # characters of ``text`` already handed out
        self.stopped = False

    def add_tokens(self, ids: Sequence[int]) -> None:
        """Decode ``ids`` (the full output list, of which the new part is beyond the read offset)."""
        self._advance(ids, finishing=False)

    def finish_pending(self, ids: Sequence[int]) -> None:
        """At finish: emit trailing tokens even if they end in an incomplete character."""
        self._advance(ids, finishing=True)

    def _advance(self, ids: Sequence[int], finishing: bool) -> None:
        end = len(self._context) + len(ids)
        if self.stopped or end <= self._read:
            return
        prefix_text = self._decode(self._window(ids, self._prefix, self._read))
        full_text = self._decode(self._window(ids, self._prefix, end))
        look = len(ids) >= self._min_tokens
        if not finishing and full_text.endswith(REPLACEMENT_CHAR):
            # Waiting for the rest of a character; the whole characters before it are final, and
            # a stop string complete in them ends generation now, not one token later.
            settled = full_text.rstrip(REPLACEMENT_CHAR)
            if look and self._stop and len(settled) > len(prefix_text):
                self._find_stop(self.text + settled[len(prefix_text) :], len(self.text))
            return
        if not finishing and len(full_text) <= len(prefix_text):
            return
        before = len(self.text)
        self.text += full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, end
        if look:
            self._find_stop(self.text, before)

    def _window(self, ids: Sequence[int], start: int, end: int) -> list[int]:
        """(context + ids)[start:end] without copying the whole output list."""
        skip = len(self._context)
        return self._context[start:end] + list(ids[max(start - skip, 0) : end - skip])

    def _find_stop(self, text: str, before: int) -> None:
        """Cut ``text`` (``self.text`` and maybe more) at the earliest stop string in it that ends
        after ``before`` (text searched before has none), and stop; nothing when there is none."""
        best, length = -1, 0
        for s in self._stop:
            at = text.find(s, max(0, before - len(s) + 1))
            if at != -1 and (best == -1 or at < best or (at == best and len(s) > length)):
                best, length = at, len(s)
        if best != -1:
            self.text = text[: best + length] if self._include_stop else text[:best]
            self.stopped = True

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; holds back a possible stop-string prefix unless finished."""
        limit = len(self.text) if (finished or self.stopped) else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : limit]
        self._emitted = limit
        return delta

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]
