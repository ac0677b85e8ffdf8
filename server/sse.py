"""Server-sent events as the OpenAI API streams them: one JSON object per event, ``[DONE]`` last."""

from __future__ import annotations

import json
from typing import Any

DONE = "[DONE]"  # the data of the last event of an OpenAI stream (not JSON)
DONE_EVENT = f"data: {DONE}\n\n"


def encode_event(body: dict[str, Any]) -> str:
    """One event carrying ``body`` as compact JSON (non-ASCII text kept as is)."""
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
