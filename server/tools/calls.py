"""A parsed tool call and its ``id``, in OpenAI's response shape."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Any

_ALNUM = string.ascii_letters + string.digits


@dataclass(slots=True)
class ToolCall:
    """One call the model made: ``arguments`` is the JSON text it wrote (OpenAI passes it on as
    a string, and so do we: the streamed fragments join to exactly this)."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        """``choices[].message.tool_calls[]``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id(length: int = 0) -> str:
    """A fresh call id: ``call_`` + 24 hex digits (OpenAI's look), or ``length`` letters and
    digits where a template demands it (Mistral's: 9)."""
    if length:
        return "".join(secrets.choice(_ALNUM) for _ in range(length))
    return "call_" + secrets.token_hex(12)
