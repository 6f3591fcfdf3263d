"""ChatRenderWorkers: the threads chat templates render in, apart from every other route's.

A render holds its thread until it ends (jinja cannot stop one from outside), for up to the
render's budget (``runtime/chat_template_budget.py``: ``MAX_TEMPLATE_STEPS``,
``MAX_RENDER_SECONDS``, 10 s). On the event loop's default executor (``asyncio.to_thread``),
a few requests whose ``chat_template_kwargs`` drive a template's loops took every thread that
``/metrics`` and the encoding of long prompts wait for. Here renders get ``threads`` threads of
their own (``BoundedWorkers``): at most ``max_in_progress`` renders are in progress, running or
waiting for a thread, and one more is refused at once with ``ChatRenderBusy`` (the route's 429
``too_many_chat_renders``). Typical renders take 20-70 us, so under a normal load the queue
stays short; renders are pure Python, so more threads would not render faster (the GIL), they
only let more slow renders run side by side.
"""
from __future__ import annotations

from runtime.server.bounded_workers import BoundedWorkers

CHAT_RENDER_THREADS = 4  # renders running at once
CHAT_RENDER_MAX_IN_PROGRESS = 256  # running or waiting for a thread; past it, a 429


class ChatRenderBusy(Exception):
    """``max_in_progress`` chat template renders are already in progress."""


class ChatRenderWorkers(BoundedWorkers):
    """``BoundedWorkers`` for chat template renders (threads named ``lorafleet-chat-template``)."""

    def __init__(self, threads: int = CHAT_RENDER_THREADS, max_in_progress: int = CHAT_RENDER_MAX_IN_PROGRESS) -> None:
        super().__init__(threads, max_in_progress, "lorafleet-chat-template")

    def busy(self, in_progress: int) -> Exception:
        return ChatRenderBusy(f"{in_progress} chat template renders are already in progress (at most {self.max_in_progress}, "
                              f"{self.threads} at a time); retry shortly")
