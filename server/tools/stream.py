"""Tool calls in OpenAI's streaming shape: each :class:`ToolEvent` as one chunk's ``delta``.

A call's first delta has ``index``, ``id``, ``type`` and ``function.name`` (arguments ``""``);
then ``function.arguments`` fragments with just the ``index``; content between calls is a
``content`` delta of its own. The last chunk's ``finish_reason`` is ``tool_calls`` when the
answer made calls and ended by itself (``length`` stays ``length``).
"""

from __future__ import annotations

from typing import Any

from splitserve.server.tools.events import ToolEvent
from splitserve.server.tools.formats import ToolCallFormat
from splitserve.server.tools.parsers import create_parser


class ToolCallStream:
    """Turns one answer's text, piece by piece, into chat deltas (``{"content": ...}`` or
    ``{"tool_calls": [...]}``); ``functions``: name -> ``parameters`` of the request's
    functions (``server.tools.parsers.create_parser``)."""

    def __init__(self, fmt: ToolCallFormat,
                 functions: dict[str, dict[str, Any]] | None = None) -> None:
        self.extractor = create_parser(fmt, functions)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas for the next piece of text."""
        return [_delta(e) for e in self.extractor.feed(text)] if text else []

    def finish(self, cut: bool = False) -> list[dict[str, Any]]:
        """Deltas for what was held back at the end (``cut``: ``max_tokens`` ended the answer;
        a call's cut-off start is dropped)."""
        return [_delta(e) for e in self.extractor.finish(cut)]

    def finish_reason(self, engine_reason: str) -> str:
        """``tool_calls`` for an answer with calls that ended by itself, else the engine's."""
        return finish_reason(engine_reason, bool(self.extractor.calls))


def finish_reason(engine_reason: str, made_calls: bool) -> str:
    """OpenAI's ``finish_reason`` of an answer: ``tool_calls`` replaces ``stop`` when the
    answer made calls."""
    return "tool_calls" if made_calls and engine_reason == "stop" else engine_reason


def _delta(event: ToolEvent) -> dict[str, Any]:
    if event.content is not None:
        return {"content": event.content}
    if event.name is not None:
        call = {"index": event.index, "id": event.call_id, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
    else:
        call = {"index": event.index, "function": {"arguments": event.arguments}}
    return {"tool_calls": [call]}
