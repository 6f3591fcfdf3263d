"""OutputMailbox: a request's outputs waiting for its consumer, merged while they wait.

Every ``RequestOutput`` carries the whole output so far (``token_ids``, ``text``,
``logprobs``) and what its step added (``new_token_ids``, ``new_text``). A queue that kept
each one would hold a full copy per step for a consumer that reads slower than the engine
steps (a streaming client that stopped reading): memory growing with the square of the
output length. Here, once ``KEEP_SEPARATE`` outputs wait, an output that arrives replaces the
last one waiting:

    merged = later, with new_token_ids = earlier.new_token_ids + later.new_token_ids
                    and  new_text      = earlier.new_text      + later.new_text

so a request holds at most ``KEEP_SEPARATE`` outputs, whatever the backlog. The consumer sees one
update that covers the steps it missed, exactly what it would have read back to back
(``new_logprobs`` follows from the lengths), as vLLM's output collector does for a consumer
that falls behind. A consumer that keeps up, give or take a few steps (the event loop busy with
other streams), still gets one output per step: streamed chunks, and the running usage that
benchmarks time tokens by, stay per token. An output that does not continue the one before it
(an error output with no tokens, or one after a finished output) queues unmerged.

Single-threaded: ``put`` and ``get`` run on the consumer's event loop (the engine hands outputs
over with ``loop.call_soon_threadsafe(mailbox.put, output)``).
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections import deque

from runtime.request import RequestOutput


class OutputMailbox:
    KEEP_SEPARATE = 8  # outputs waiting before later ones merge into the last

    def __init__(self) -> None:
        # Each entry: the latest output, plus the new_* parts of the earlier ones it absorbed (joined on get).
        self._waiting: deque[tuple[RequestOutput, list[tuple[int, ...]], list[str]]] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        """Outputs waiting (merged ones count once)."""
        return len(self._waiting)

    def put(self, out: RequestOutput) -> None:
        if len(self._waiting) >= self.KEEP_SEPARATE and _continues(self._waiting[-1][0], out):
            _, ids, texts = self._waiting.pop()
            ids.append(out.new_token_ids)
            texts.append(out.new_text)
            self._waiting.append((out, ids, texts))
        else:
            self._waiting.append((out, [out.new_token_ids], [out.new_text]))
        self._ready.set()

    async def get(self) -> RequestOutput:
        while not self._waiting:
            self._ready.clear()
            await self._ready.wait()
        out, ids, texts = self._waiting.popleft()
        if len(ids) == 1:
            return out
        return dataclasses.replace(out, new_token_ids=tuple(t for part in ids for t in part), new_text="".join(texts))


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
