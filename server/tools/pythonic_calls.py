"""Pythonic tool calls (Llama 3.2's pythonic template, Llama 4): the parser, and their grammar.

The model writes one Python list of calls with keyword arguments::

    [get_weather(city="Paris", days=3), add(a=1, b=2)]

A list starts where ``[`` is followed by a function's name and ``(`` (one of the request's
functions, so a bracket in prose is not taken for a call); the arguments are Python literals,
read with :func:`ast.literal_eval` and given out as JSON (``True`` -> ``true``, tuples ->
lists). A call is given out whole once its ``)`` arrives (its name and its arguments in two
events). A list whose first call does not parse is text.

The grammar is EBNF built from each function's ``parameters`` (``server.tools.pythonic_grammar``).

Reference: vLLM ``pythonic_tool_parser.py`` (``ast`` over the list); the Llama 3.2 pythonic
chat template's own instructions (``[func_name1(params_name1=params_value1, ...)]``).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any

from splitserve.server.tools.events import ToolEvent
from splitserve.server.tools.formats import PythonicFormat
from splitserve.server.tools.markup import MarkupCallParser
from splitserve.server.tools.scan import skip_ws

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class PythonicCallParser(MarkupCallParser):
    """Content and calls of one answer written as a pythonic call list.

    Args:
        fmt: the format.
        functions: name -> ``parameters`` schema; a list starts only at one of these names.
        call_ids: makes each call's ``id``.
    """

    def __init__(self, fmt: PythonicFormat, functions: dict[str, dict[str, Any]],
                 call_ids: Callable[[], str] | None = None) -> None:
        super().__init__([f"[{name}(" for name in functions], "", call_ids)
        self.fmt = fmt
        self._name = ""
        self._state = ""
        self._scan = _ArgsScanner()
        self._in_list = 0  # calls of the current list so far

    def _begin(self, trigger: str) -> None:
        self._name, self._in_list = trigger[1:-1], 0
        self._state, self._scan = "args", _ArgsScanner()

    def _call_step(self, events: list[ToolEvent]) -> bool:
        if self._state == "args":
            end = self._scan.feed(self._buf)
            if end < 0:
                return False
            arguments = call_arguments(self._buf[:end])
            if arguments is None:
                return self._not_a_call(events)
            self._buf = self._buf[end + 1:]
            self._new_call(self._name, events)
            self._arguments(arguments, events)
            self._in_list += 1
            self._state = "next"
            return True
        buf = self._buf  # "next": ", NAME(" or "]"
        i = skip_ws(buf, 0)
        if i == len(buf):
            return False
        if buf[i] == "]":
            self._buf = buf[i + 1:]
            self._to_text()
            return True
        if buf[i] != ",":
            self._buf = buf[i:]
            self._to_text()
            return True
        j = skip_ws(buf, i + 1)
        if j == len(buf):
            return False
        name = _IDENT.match(buf, j)
        if name is not None and name.end() == len(buf):
            return False  # the name may go on
        if name is None or buf[name.end()] != "(":
            self._to_text()  # no further call: the rest is text
            return True
        self._name = name.group()
        self._buf = buf[name.end() + 1:]
        self._state, self._scan = "args", _ArgsScanner()
        return True

    def _not_a_call(self, events: list[ToolEvent]) -> bool:
        if self._in_list == 0:
            self._give_back(events)
        else:
            self._to_text()
        return True

    def _finish_call(self, events: list[ToolEvent]) -> None:
        if self._in_list == 0:
            super()._finish_call(events)  # given back, or dropped when the answer was cut
        else:
            self._buf = ""  # cut inside the list: the calls made stay
            self._to_text()


class _ArgsScanner:
    """Finds the ``)`` that closes a call's arguments, a chunk at a time (Python strings with
    either quote and escapes, nested brackets)."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote = ""
        self.escaped = False
        self.pos = 0  # characters of the buffer already scanned

    def feed(self, buf: str) -> int:
        """The index in ``buf`` of the closing ``)``, or -1 (``buf`` only grows between
        calls)."""
        for i in range(self.pos, len(buf)):
            ch = buf[i]
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "\"'":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                if self.depth == 0:
                    return i
                self.depth -= 1
        self.pos = len(buf)
        return -1


def call_arguments(text: str) -> str | None:
    """Keyword arguments ``text`` (``a=1, b="x"``) as a JSON object's text, or None when they
    are not keyword arguments with literal values."""
    try:
        node = ast.parse(f"f({text})", mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    out: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            out[keyword.arg] = _jsonable(ast.literal_eval(keyword.value))
            json.dumps(out[keyword.arg])
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    return json.dumps(out, ensure_ascii=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value
