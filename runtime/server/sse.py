"""Server-sent events framing for streamed completions."""
from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def event(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
