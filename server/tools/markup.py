"""The text side every markup-delimited tool-call parser shares (XML, pythonic, DeepSeek).

:class:`MarkupCallParser` watches the text for the format's triggers, holding back an end that
might be the start of one, and hands the text from a trigger on to its subclass's call states.
Whitespace (and the format's separator) between calls is not content: it is held and only given
out when ordinary text follows (trailing whitespace is content only in an answer with no call),
as the JSON families' parser (``server.tools.extract``) does. Markup that stops matching before
its call's name is complete is given back: its first character is text and scanning resumes
after it.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

from splitserve.server.tools.calls import ToolCall, new_call_id
from splitserve.server.tools.events import BaseToolCallParser, ToolEvent, merge_events
from splitserve.server.tools.scan import WS, first_trigger, partial_suffix


class MarkupCallParser(BaseToolCallParser):
    """Text, and calls that start at a trigger.

    Args:
        triggers: the texts that start a call's markup.
        separator: written between calls besides whitespace (not content).
        call_ids: makes each call's ``id`` (default: OpenAI-style :func:`new_call_id`).
    """

    def __init__(self, triggers: list[str], separator: str = "",
                 call_ids: Callable[[], str] | None = None) -> None:
        self.calls: list[ToolCall] = []
        self._triggers = triggers
        self._gap_chars = WS + separator.strip()
        self._new_id = call_ids or new_call_id
        self._buf = ""
        self._gap = ""  # whitespace / separators held in text
        self._start = ""  # the markup so far of a call whose name is not complete yet
        self._in_text = True
        self._cut = False  # finish(cut=True): the answer was cut, held markup is dropped

    # ---- the subclass's part -------------------------------------------------------------------

    @abstractmethod
    def _begin(self, trigger: str) -> None:
        """A trigger was found (and consumed, as ``self._start``): enter the call states."""

    @abstractmethod
    def _call_step(self, events: list[ToolEvent]) -> bool:
        """Consume what the call states can from ``self._buf``; False when more text is
        needed."""

    def _finish_call(self, events: list[ToolEvent]) -> None:
        """The answer ended inside a call's markup (default: before its name was complete, so
        it is given back as text, or dropped when the answer was cut: :meth:`finish`)."""
        if self._cut:
            self._to_text()
            self._buf = ""
        else:
            self._give_back(events)

    # ---- BaseToolCallParser --------------------------------------------------------------------

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        events: list[ToolEvent] = []
        while self._step(events):
            pass
        return merge_events(events)

    def finish(self, cut: bool = False) -> list[ToolEvent]:
        self._cut = cut
        events: list[ToolEvent] = []
        while not self._in_text:
            self._finish_call(events)
            while self._step(events):
                pass
        held = partial_suffix(self._buf, self._triggers) if cut else 0  # a cut marker's start
        self._emit_text(self._buf[: len(self._buf) - held], events)
        if not self.calls:  # trailing whitespace is content only in an answer with no call
            events.append(ToolEvent(content=self._gap))
        self._buf, self._gap = "", ""
        return merge_events(events)

    # ---- helpers for the call states -----------------------------------------------------------

    def _step(self, events: list[ToolEvent]) -> bool:
        return self._text(events) if self._in_text else self._call_step(events)

    def _text(self, events: list[ToolEvent]) -> bool:
        buf = self._buf
        hit, trigger = first_trigger(buf, self._triggers)
        if hit < 0:
            keep = partial_suffix(buf, self._triggers)
            self._emit_text(buf[: len(buf) - keep], events)
            self._buf = buf[len(buf) - keep:]
            return False
        self._emit_text(buf[:hit], events)
        self._start, self._buf = trigger, buf[hit + len(trigger):]
        self._in_text = False
        self._begin(trigger)
        return True

    def _emit_text(self, text: str, events: list[ToolEvent]) -> None:
        """Text outside calls: gaps are held until ordinary text follows them."""
        if not text:
            return
        body = text.rstrip(self._gap_chars)
        if body:
            events.append(ToolEvent(content=self._gap + body))
            self._gap = ""
        self._gap += text[len(body):]

    def _to_text(self) -> None:
        """A call's markup ended: back to text."""
        self._in_text, self._start = True, ""

    def _give_back(self, events: list[ToolEvent]) -> None:
        """The markup stopped matching before a call began: its first character is text."""
        raw = self._start + self._buf
        self._to_text()
        self._emit_text(raw[:1], events)
        self._buf = raw[1:]

    def _consume(self, n: int) -> None:
        """``n`` characters of markup read (kept in ``_start`` until the name completes)."""
        self._start += self._buf[:n]
        self._buf = self._buf[n:]

    def _new_call(self, name: str, events: list[ToolEvent]) -> None:
        call = ToolCall(self._new_id(), name, "")
        self.calls.append(call)
        self._gap, self._start = "", ""  # whitespace between text and a call is not content
        events.append(ToolEvent(index=len(self.calls) - 1, call_id=call.id, name=name))

    def _arguments(self, fragment: str, events: list[ToolEvent]) -> None:
        if fragment:
            self.calls[-1].arguments += fragment
            events.append(ToolEvent(index=len(self.calls) - 1, arguments=fragment))
