"""An answer's text as Anthropic content blocks and their stream events, from one stream of
``(reasoning_delta, content_delta)`` pairs: the streamed answer and the full one alike.

:class:`BlockStream` turns each pair into the ``content_block_start`` /
``content_block_delta`` / ``content_block_stop`` events of Anthropic's streaming format:
reasoning into a ``thinking`` block (``thinking_delta``), content into ``text`` blocks
(``text_delta``) and, with tools, the calls the tool-call parser (``server.tools.extract``)
finds in it into ``tool_use`` blocks (``input_json_delta`` fragments of the input's JSON, as
the model writes it). A block opens when its kind of text first arrives and closes when
another kind begins or the answer ends, so blocks come in the order the model wrote them.

The full (non-streamed) answer is those events gathered (:func:`gather_blocks`), so a streamed
answer reassembles to exactly the full one. Until a reasoning parser feeds reasoning deltas,
every pair has an empty reasoning part and no ``thinking`` block appears.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from splitserve.server.tools.extract import ToolCallExtractor, ToolEvent
from splitserve.server.tools.formats import ToolCallFormat


def new_tool_use_id() -> str:
    """A fresh ``tool_use`` id: ``toolu_`` + 24 hex digits (Anthropic's look)."""
    return "toolu_" + secrets.token_hex(12)


class BlockStream:
    """The content-block events of one answer.

    Args:
        tool_format: the envelope the model writes calls in (None: the answer has no calls,
            all content is text).
    """

    def __init__(self, tool_format: ToolCallFormat | None) -> None:
        self.calls = (None if tool_format is None
                      else ToolCallExtractor(tool_format, call_ids=new_tool_use_id))
        self.index = -1  # the open (or last) block's index
        self.open: str | None = None  # the open block's type

    @property
    def made_calls(self) -> bool:
        """Whether the answer holds a ``tool_use`` block."""
        return bool(self.calls is not None and self.calls.calls)

    def feed(self, content: str, reasoning: str = "") -> list[dict[str, Any]]:
        """The events of the next pair: its reasoning first, then its content."""
        events: list[dict[str, Any]] = []
        if reasoning:
            self._thinking(reasoning, events)
        if content:
            if self.calls is None:
                self._text(content, events)
            else:
                for ev in self.calls.feed(content):
                    self._tool_event(ev, events)
        return events

    def finish(self, cut: bool = False) -> list[dict[str, Any]]:
        """The events of what the parser held back (``cut``: ``max_tokens`` ended the answer;
        a call's cut-off start is dropped), and the last block's stop."""
        events: list[dict[str, Any]] = []
        if self.calls is not None:
            for ev in self.calls.finish(cut):
                self._tool_event(ev, events)
        self._close(events)
        return events

    def _tool_event(self, ev: ToolEvent, events: list[dict[str, Any]]) -> None:
        if ev.content is not None:
            self._text(ev.content, events)
        elif ev.name is not None:
            self._start({"type": "tool_use", "id": ev.call_id, "name": ev.name, "input": {}},
                        events)
        elif ev.arguments:
            events.append(self._delta({"type": "input_json_delta",
                                       "partial_json": ev.arguments}))

    def _text(self, text: str, events: list[dict[str, Any]]) -> None:
        if not text:
            return
        if self.open != "text":
            self._start({"type": "text", "text": ""}, events)
        events.append(self._delta({"type": "text_delta", "text": text}))

    def _thinking(self, text: str, events: list[dict[str, Any]]) -> None:
        if self.open != "thinking":
            self._start({"type": "thinking", "thinking": "", "signature": ""}, events)
        events.append(self._delta({"type": "thinking_delta", "thinking": text}))

    def _start(self, block: dict[str, Any], events: list[dict[str, Any]]) -> None:
        self._close(events)
        self.index += 1
        self.open = block["type"]
        events.append({"type": "content_block_start", "index": self.index,
                       "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _close(self, events: list[dict[str, Any]]) -> None:
        if self.open is not None:
            events.append({"type": "content_block_stop", "index": self.index})
            self.open = None


def gather_blocks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks that ``events`` (a :class:`BlockStream`'s, in order) stream, as a
    full answer carries them: a ``tool_use`` block's ``input`` is its fragments' JSON parsed
    (``{}`` where they are not a JSON object: a call cut off by ``max_tokens``)."""
    blocks: list[dict[str, Any]] = []
    inputs: dict[int, list[str]] = {}
    for ev in events:
        kind = ev["type"]
        if kind == "content_block_start":
            blocks.append(dict(ev["content_block"]))
        elif kind == "content_block_delta":
            block, delta = blocks[ev["index"]], ev["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                inputs.setdefault(ev["index"], []).append(delta["partial_json"])
    for index, parts in inputs.items():
        blocks[index]["input"] = _object("".join(parts))
    return blocks


def _object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
