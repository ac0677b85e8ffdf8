"""Model text -> content and tool calls for the JSON families (Hermes, Llama 3 JSON, Mistral),
incrementally: the streaming and the full answer alike.

:class:`ToolCallExtractor` is fed the detokenized text as it arrives and returns
:class:`ToolEvent` s: content text outside any call, the start of a call (its name, once the
name is complete), and fragments of the call's arguments, as OpenAI's streaming deltas carry
them. The full (non-streaming) answer is the same events gathered
(``server.tools.parsers.parse_tool_calls``), so a streamed answer reassembles to exactly the
full one.

Text that might be the start of a call marker is held back until it is clear, so no markup
reaches ``content``. Whitespace (and the format's separator) between calls is not content:
it is held and only emitted when ordinary text follows it. Under the grammar
(``server.tools.grammar``) the model cannot write a malformed envelope; without it (a model
that writes a marker on its own), an envelope that stops matching before its name is complete
is given back as content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import Enum

from splitserve.server.tools.calls import ToolCall, new_call_id
from splitserve.server.tools.events import BaseToolCallParser, ToolEvent, merge_events
from splitserve.server.tools.formats import ToolCallFormat
from splitserve.server.tools.scan import MISMATCH as _MISMATCH
from splitserve.server.tools.scan import NEED as _NEED
from splitserve.server.tools.scan import WS as _WS
from splitserve.server.tools.scan import ValueScanner as _ValueScanner
from splitserve.server.tools.scan import first_trigger as _first_trigger
from splitserve.server.tools.scan import match_literal as _match_literal
from splitserve.server.tools.scan import partial_suffix as _partial_suffix
from splitserve.server.tools.scan import skip_ws as _skip_ws

__all__ = ["ToolCallExtractor", "ToolEvent"]


class _State(Enum):
    TEXT = "text"  # ordinary text, watching for a marker
    LIST_OPEN = "list_open"  # after Mistral's marker: ``[``
    HEADER = "header"  # ``{"name": "N", "arguments": ``
    ARGS = "args"  # the arguments value, streamed
    OBJECT_END = "object_end"  # ``}`` closing the call object
    CLOSE = "close"  # the end marker (``</tool_call>``)
    LIST_NEXT = "list_next"  # ``,`` and the next object, or ``]``




class ToolCallExtractor(BaseToolCallParser):
    """Splits one answer's text into content and calls in ``fmt`` (a JSON family: Hermes,
    Llama 3 JSON, Mistral).

    Args:
        fmt: the envelope the model writes.
        call_ids: makes each call's ``id`` (default: :func:`new_call_id` for ``fmt``).
    """

    def __init__(self, fmt: ToolCallFormat, call_ids: Callable[[], str] | None = None) -> None:
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self._new_id = call_ids or (lambda: new_call_id(fmt.id_length))
        self._buf = ""
        self._state = _State.TEXT
        self._gap = ""  # whitespace / separators held in TEXT
        self._start = ""  # raw text of the envelope so far, given back if it stops matching
        self._tagged = False  # the current call began with ``fmt.begin`` (so ends with end)
        self._args = _ValueScanner()
        # A bare call object starts with ``{"name"`` (the grammar writes ``{"name": "``).
        bare = fmt.bare_calls or not fmt.begin
        self._triggers = ([fmt.begin] if fmt.begin else []) + (['{"name"'] if bare else [])

    def feed(self, text: str) -> list[ToolEvent]:
        """Events for ``text`` (appended to what came before)."""
        self._buf += text
        events: list[ToolEvent] = []
        while self._step(events):
            pass
        return _merge(events)

    def finish(self, cut: bool = False) -> list[ToolEvent]:
        """Events for what is still held at the end of the answer. An envelope whose name never
        completed, or a marker's first characters, are given back as content, or dropped when
        ``cut`` (the start of a call ``max_tokens`` cut off); a call cut off in its arguments
        stays a call (its arguments truncated, as OpenAI's are at ``finish_reason: length``)."""
        events: list[ToolEvent] = []
        if self._state in (_State.LIST_OPEN, _State.HEADER):
            if cut:
                self._state, self._start, self._buf = _State.TEXT, "", ""
            else:
                self._give_back(events)
        if self._state is _State.TEXT:
            held = _partial_suffix(self._buf, self._triggers) if cut else 0
            self._emit_text(self._buf[: len(self._buf) - held], events)
            if not self.calls:  # trailing whitespace is content only in an answer with no call
                events.append(ToolEvent(content=self._gap))
        self._buf, self._gap = "", ""
        return _merge(events)

    # ---- the state machine -------------------------------------------------------------------

    def _step(self, events: list[ToolEvent]) -> bool:
        """Consume what the current state can from the buffer; False when it needs more text."""
        if self._state is _State.TEXT:
            return self._text(events)
        if self._state is _State.LIST_OPEN:
            return self._literal("[", _State.HEADER, events)
        if self._state is _State.HEADER:
            return self._header(events)
        if self._state is _State.ARGS:
            return self._arguments(events)
        if self._state is _State.OBJECT_END:
            nxt = _State.LIST_NEXT if self.fmt.in_list else (
                _State.CLOSE if self._tagged else _State.TEXT)
            return self._literal("}", nxt, events)
        if self._state is _State.CLOSE:
            return self._literal(self.fmt.end, _State.TEXT, events)
        return self._list_next(events)

    def _text(self, events: list[ToolEvent]) -> bool:
        buf = self._buf
        hit, trigger = _first_trigger(buf, self._triggers)
        if hit < 0:
            keep = _partial_suffix(buf, self._triggers)
            self._emit_text(buf[: len(buf) - keep], events)
            self._buf = buf[len(buf) - keep:]
            return False
        self._emit_text(buf[:hit], events)
        self._tagged = trigger == self.fmt.begin
        skip = len(trigger) if self._tagged else 0
        self._start, self._buf = buf[hit: hit + skip], buf[hit + skip:]
        self._state = _State.LIST_OPEN if self.fmt.in_list else _State.HEADER
        return True

    def _emit_text(self, text: str, events: list[ToolEvent]) -> None:
        """Text in TEXT state: gaps are held until ordinary text follows them."""
        if not text:
            return
        gap_chars = _WS + self.fmt.separator.strip()
        body = text.rstrip(gap_chars)
        if body:
            events.append(ToolEvent(content=self._gap + body))
            self._gap = ""
        self._gap += text[len(body):]

    def _literal(self, literal: str, nxt: _State, events: list[ToolEvent]) -> bool:
        at = _match_literal(self._buf, 0, literal)
        if at == _NEED:
            return False
        if at == _MISMATCH:
            if self._state is _State.LIST_OPEN:
                self._give_back(events)
            else:  # a call already went out; the rest is text
                self._state = _State.TEXT
            return True
        self._start += self._buf[:at]
        self._buf = self._buf[at:]
        self._state = nxt
        return True

    def _header(self, events: list[ToolEvent]) -> bool:
        at, name = _match_header(self._buf, self.fmt.args_key)
        if at == _NEED:
            return False
        if at == _MISMATCH:
            self._give_back(events)
            return True
        call = ToolCall(self._new_id(), name, "")
        self.calls.append(call)
        self._gap = ""  # whitespace between text and a call is not content
        events.append(ToolEvent(index=len(self.calls) - 1, call_id=call.id, name=name))
        self._buf, self._start = self._buf[at:], ""
        self._args = _ValueScanner()
        self._state = _State.ARGS
        return True

    def _arguments(self, events: list[ToolEvent]) -> bool:
        used, done = self._args.feed(self._buf)
        if used:
            fragment = self._buf[:used]
            self.calls[-1].arguments += fragment
            events.append(ToolEvent(index=len(self.calls) - 1, arguments=fragment))
            self._buf = self._buf[used:]
        if done:
            self._state = _State.OBJECT_END
        return done

    def _list_next(self, events: list[ToolEvent]) -> bool:
        i = _skip_ws(self._buf, 0)
        if i == len(self._buf):
            return False
        if self._buf[i] == ",":
            self._buf = self._buf[i + 1:]
            self._state = _State.HEADER
        elif self._buf[i] == "]":
            self._buf = self._buf[i + 1:]
            self._state = _State.TEXT
        else:
            self._state = _State.TEXT
        return True

    def _give_back(self, events: list[ToolEvent]) -> None:
        """The envelope stopped matching before a call began: its first character is text,
        and scanning resumes right after it."""
        raw = self._start + self._buf
        self._state = _State.TEXT
        self._emit_text(raw[:1], events)
        self._start, self._buf = "", raw[1:]


_merge = merge_events


def _match_string(buf: str, i: int) -> tuple[int, str]:
    """A JSON string at ``buf[i:]`` (after whitespace): (index after it, its value)."""
    i = _skip_ws(buf, i)
    if i == len(buf):
        return _NEED, ""
    if buf[i] != '"':
        return _MISMATCH, ""
    j, escaped = i + 1, False
    while j < len(buf):
        ch = buf[j]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            try:
                return j + 1, json.loads(buf[i: j + 1])
            except json.JSONDecodeError:
                return _MISMATCH, ""
        j += 1
    return _NEED, ""


def _match_header(buf: str, args_key: str) -> tuple[int, str]:
    """``{"name": "N", "<args_key>": `` and the whitespace after it, at the start of ``buf``,
    followed by the ``{`` of the arguments object: (index of that ``{``, N), or _NEED /
    _MISMATCH."""
    i, name = 0, ""
    for piece in ("{", '"name"', ":", None, ",", f'"{args_key}"', ":"):
        if piece is None:
            i, name = _match_string(buf, i)
        else:
            i = _match_literal(buf, i, piece)
        if i < 0:
            return i, ""
    i = _skip_ws(buf, i)
    if i == len(buf):
        return _NEED, ""
    # Arguments are an object: anything else is not a call (the envelope is given back as text).
    return (i, name) if buf[i] == "{" else (_MISMATCH, "")
