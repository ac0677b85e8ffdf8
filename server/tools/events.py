"""What a tool-call parser gives back, and the interface every format's parser implements.

A parser (one per answer) is fed the detokenized text as it arrives and returns
:class:`ToolEvent` s: content text outside any call, the start of a call (its name, once the
name is complete), and fragments of the call's arguments (JSON text), as OpenAI's streaming
deltas carry them. The full answer is the same events gathered, so a streamed answer
reassembles to exactly the full one whatever the chunking (``tests/server/
test_tool_stream_boundaries.py`` splits every format's reference outputs at every position).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from splitserve.server.tools.calls import ToolCall


@dataclass(slots=True)
class ToolEvent:
    """One piece of the answer: ``content`` text, or a call's start (``name`` set, with its
    ``call_id``) or an ``arguments`` fragment of call ``index``."""

    content: str | None = None
    index: int = -1
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


class BaseToolCallParser(ABC):
    """Splits one answer's text into content and calls.

    ``calls`` holds the calls begun so far (their ``arguments`` growing as fragments come).
    Text that might still be call markup is held back until it is clear, so no markup is ever
    given out as content.
    """

    calls: list[ToolCall]

    @abstractmethod
    def feed(self, text: str) -> list[ToolEvent]:
        """Events for ``text`` (appended to what came before)."""

    @abstractmethod
    def finish(self, cut: bool = False) -> list[ToolEvent]:
        """Events for what is still held at the end of the answer: markup whose call never got
        its name is content when the answer ended by itself (a model writing text that looks
        like a marker), and dropped when ``cut`` (``max_tokens`` ended the answer inside the
        start of a call: no markup reaches content); a call cut off in its arguments stays a
        call (its arguments truncated, as OpenAI's are at ``finish_reason: length``)."""


def merge_events(events: list[ToolEvent]) -> list[ToolEvent]:
    """Adjacent content events, and adjacent argument fragments of one call, as one event;
    empty content dropped."""
    out: list[ToolEvent] = []
    for ev in events:
        last = out[-1] if out else None
        if last is not None and ev.content is not None and last.content is not None:
            last.content += ev.content
        elif (last is not None and ev.arguments is not None and last.arguments is not None
              and last.index == ev.index):
            last.arguments += ev.arguments
        elif ev.content != "":
            out.append(ev)
    return out
