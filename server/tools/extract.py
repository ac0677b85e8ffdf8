"""Model text -> content and tool calls, incrementally: the streaming and the full answer alike.

:class:`ToolCallExtractor` is fed the detokenized text as it arrives and returns
:class:`ToolEvent` s: content text outside any call, the start of a call (its name, once the
name is complete), and fragments of the call's arguments, as OpenAI's streaming deltas carry
them. The full (non-streaming) answer is the same events gathered (:func:`parse_tool_calls`),
so a streamed answer reassembles to exactly the full one.

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
from dataclasses import dataclass
from enum import Enum

from splitserve.server.tools.calls import ToolCall, new_call_id
from splitserve.server.tools.formats import ToolCallFormat


@dataclass(slots=True)
class ToolEvent:
    """One piece of the answer: ``content`` text, or a call's start (``name`` set, with its
    ``call_id``) or an ``arguments`` fragment of call ``index``."""

    content: str | None = None
    index: int = -1
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


class _State(Enum):
    TEXT = "text"  # ordinary text, watching for a marker
    LIST_OPEN = "list_open"  # after Mistral's marker: ``[``
    HEADER = "header"  # ``{"name": "N", "arguments": ``
    ARGS = "args"  # the arguments value, streamed
    OBJECT_END = "object_end"  # ``}`` closing the call object
    CLOSE = "close"  # the end marker (``</tool_call>``)
    LIST_NEXT = "list_next"  # ``,`` and the next object, or ``]``


_WS = " \t\r\n"
_NEED, _MISMATCH = -1, -2  # scan results besides "matched up to index i"


class ToolCallExtractor:
    """Splits one answer's text into content and calls in ``fmt``.

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

    def finish(self) -> list[ToolEvent]:
        """Events for what is still held at the end of the answer. An envelope whose name never
        completed is given back as content; a call cut off in its arguments stays a call (its
        arguments truncated, as OpenAI's are at ``finish_reason: length``)."""
        events: list[ToolEvent] = []
        if self._state in (_State.LIST_OPEN, _State.HEADER):
            self._give_back(events)
        if self._state is _State.TEXT:
            self._emit_text(self._buf, events)
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


@dataclass(slots=True)
class _ValueScanner:
    """Finds where one JSON value ends, a chunk at a time (strings, escapes, nesting)."""

    depth: int = 0
    started: bool = False
    in_string: bool = False
    escaped: bool = False
    scalar: bool = False

    def feed(self, text: str) -> tuple[int, bool]:
        """``(characters of text that belong to the value, whether the value is complete)``."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch in _WS:
                    continue
                self.started = True
                if ch == '"':
                    self.in_string = True
                elif ch in "{[":
                    self.depth = 1
                else:
                    self.scalar = True
                continue
            if self.scalar:
                if ch in _WS + ",}]":
                    return i, True
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1, True
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
        return len(text), False


def parse_tool_calls(text: str, fmt: ToolCallFormat,
                     call_ids: Callable[[], str] | None = None) -> tuple[str, list[ToolCall]]:
    """The whole answer's ``(content, calls)``, exactly what streaming it would deliver."""
    extractor = ToolCallExtractor(fmt, call_ids)
    events = extractor.feed(text) + extractor.finish()
    content = "".join(e.content for e in events if e.content is not None)
    return content, extractor.calls


def _merge(events: list[ToolEvent]) -> list[ToolEvent]:
    """Adjacent content events, and adjacent argument fragments of one call, as one event."""
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


def _first_trigger(buf: str, triggers: list[str]) -> tuple[int, str]:
    """The earliest position of any trigger in ``buf`` and which one (-1 if none)."""
    best, which = -1, ""
    for t in triggers:
        at = buf.find(t)
        if at >= 0 and (best < 0 or at < best):
            best, which = at, t
    return best, which


def _partial_suffix(buf: str, triggers: list[str]) -> int:
    """Length of the longest end of ``buf`` that a trigger starts with."""
    best = 0
    for t in triggers:
        for n in range(min(len(t) - 1, len(buf)), best, -1):
            if buf.endswith(t[:n]):
                best = n
                break
    return best


def _skip_ws(buf: str, i: int) -> int:
    while i < len(buf) and buf[i] in _WS:
        i += 1
    return i


def _match_literal(buf: str, i: int, literal: str) -> int:
    """After optional whitespace, ``literal`` at ``buf[i:]``: the index after it, or _NEED /
    _MISMATCH."""
    i = _skip_ws(buf, i)
    avail = buf[i: i + len(literal)]
    if not literal.startswith(avail):
        return _MISMATCH
    if len(avail) < len(literal):
        return _NEED
    return i + len(literal)


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
