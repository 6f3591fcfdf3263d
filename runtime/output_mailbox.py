"""OutputMailbox: a request's outputs waiting for its consumer, merged while they wait.

Every ``RequestOutput`` carries the whole output so far (``token_ids``, ``text``,
``logprobs``) and what its step added (``new_token_ids``, ``new_text``). A queue that kept
each one would hold a full copy per step for a consumer that reads slower than the engine
steps (a streaming client that stopped reading): memory growing with the square of the
output length. Here, once ``KEEP_SEPARATE`` outputs wait, an output that arrives replaces the
last one waiting, which only remembers where its new part began:

    merged = later, with new_token_ids = later.token_ids[t:]  and  new_text = later.text[c:]
    where (t, c) = the lengths of the output so far before the first output merged into it

so a request holds at most ``KEEP_SEPARATE`` outputs and two integers, whatever the backlog:
nothing grows with the steps a consumer misses (joining each step's new parts instead kept a
tuple and a string per step, ~110 bytes a token). Since an output's ``token_ids`` and ``text``
are the previous output's plus its own new parts (``_continues`` checks the lengths), the
slices are exactly the steps' new parts joined: the consumer sees one update that covers the
steps it missed, what it would have read back to back (``new_logprobs`` follows from the
lengths), as vLLM's output collector does for a consumer that falls behind. A consumer that
keeps up, give or take a few steps (the event loop busy with other streams), still gets one
output per step: streamed chunks, and the running usage that benchmarks time tokens by, stay per
token. An output that does not continue the one before it (an error output with no tokens, or
one after a finished output) queues unmerged.

``end`` closes the mailbox (a producer's last word, for streams that are not the engine's: a Ray
ingress's, ``runtime/distributed/read_ahead.py``): the outputs waiting are read first, then
``get`` raises what ``end`` was given.

Single-threaded: ``put``, ``end`` and ``get`` run on the consumer's event loop (the engine hands
outputs over with ``loop.call_soon_threadsafe(mailbox.put, output)``). Costs O(1) per ``put``;
a ``get`` of a merged output slices its new part, O(its length).
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from typing import Optional

from runtime.request import RequestOutput


class OutputMailbox:
    KEEP_SEPARATE = 8  # outputs waiting before later ones merge into the last

    def __init__(self) -> None:
        # Each entry: the latest output, and the lengths of its token_ids and text before its new part (merged ones: before the first).
        self._waiting: deque[tuple[RequestOutput, int, int]] = deque()
        self._ready = asyncio.Event()
        self._end: Optional[BaseException] = None

    def __len__(self) -> int:
        """Outputs waiting (merged ones count once)."""
        return len(self._waiting)

    def put(self, out: RequestOutput) -> None:
        if len(self._waiting) >= self.KEEP_SEPARATE and _continues(self._waiting[-1][0], out):
            _, tokens_before, chars_before = self._waiting.pop()
            self._waiting.append((out, tokens_before, chars_before))
        else:
            self._waiting.append((out, len(out.token_ids) - len(out.new_token_ids), len(out.text) - len(out.new_text)))
        self._ready.set()

    def end(self, error: BaseException) -> None:
        """No output comes after those waiting: once they are read, ``get`` raises ``error``
        (``StopAsyncIteration()`` for a stream that ended as it should)."""
        self._end = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        while not self._waiting:
            if self._end is not None:
                raise self._end
            self._ready.clear()
            await self._ready.wait()
        out, tokens_before, chars_before = self._waiting.popleft()
        if tokens_before == len(out.token_ids) - len(out.new_token_ids) and chars_before == len(out.text) - len(out.new_text):
            return out  # not merged
        return dataclasses.replace(out, new_token_ids=tuple(out.token_ids[tokens_before:]), new_text=out.text[chars_before:])


def _continues(earlier: RequestOutput, later: RequestOutput) -> bool:
    """``later`` is the next update of the request ``earlier`` left running: its output so far is
    ``earlier``'s plus its own new tokens and text (lengths are compared; the engine builds both
    from one sequence)."""
    return (
        not earlier.finished
        and later.error is None
        and later.request_id == earlier.request_id
        and len(later.token_ids) - len(later.new_token_ids) == len(earlier.token_ids)
        and len(later.text) - len(later.new_text) == len(earlier.text)
    )
