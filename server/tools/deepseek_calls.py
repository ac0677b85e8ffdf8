"""DeepSeek-V3's tool calls: the parser, and the grammar that enforces them.

The model writes one block of calls (the markers are special tokens in DeepSeek's tokenizer; the
answer's text keeps them, ``ChatRenderer.marker_tokens``)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The parser streams each call's name once its line ends and its JSON arguments as they come, as
the Hermes parser does. The grammar is an xgrammar structural tag: each marker is a ``token``
element where it is one special token of the tokenizer (which no text spells) and text
otherwise, the arguments a ``json_schema`` element.

Reference: DeepSeek-V3's chat template (``tokenizer_config.json``) and vLLM's
``deepseekv3_tool_parser.py``; xgrammar ``builtin_structural_tag.get_deepseek_r1_structural_tag``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from splitserve.server.tools.events import ToolEvent
from splitserve.server.tools.formats import DeepSeekFormat
from splitserve.server.tools.markup import MarkupCallParser
from splitserve.server.tools.scan import MISMATCH, NEED, ValueScanner, match_literal

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_FENCE_OPEN = "```json"
_FENCE_CLOSE = "```"


class DeepSeekCallParser(MarkupCallParser):
    """Content and calls of one answer in DeepSeek-V3's format.

    Args:
        fmt: the format (its markers).
        call_ids: makes each call's ``id``.
    """

    def __init__(self, fmt: DeepSeekFormat, call_ids: Callable[[], str] | None = None) -> None:
        super().__init__([fmt.begin], "", call_ids)
        self.fmt = fmt
        self._state = ""
        self._args = ValueScanner()
        self._in_block = 0  # calls of the current block so far

    def _begin(self, trigger: str) -> None:
        self._state, self._in_block = "call_begin", 0

    def _call_step(self, events: list[ToolEvent]) -> bool:
        fmt, state = self.fmt, self._state
        literals = {"call_begin": (fmt.call_begin, "function"),
                    "function": ("function", "sep"), "sep": (fmt.sep, "name"),
                    "fence": (_FENCE_OPEN, "args"), "fence_close": (_FENCE_CLOSE, "call_end"),
                    "call_end": (fmt.call_end, "next")}
        if state in literals:
            literal, nxt = literals[state]
            at = match_literal(self._buf, 0, literal)
            if at == NEED:
                return False
            if at == MISMATCH:
                return self._mismatch(events)
            self._consume(at)
            self._state = nxt
            if nxt == "args":
                self._args = ValueScanner()
            return True
        if state == "name":
            end = self._buf.find("\n")
            name = self._buf[:end] if end >= 0 else self._buf
            if (name and not _NAME.fullmatch(name)) or (end == 0):
                return self._mismatch(events)
            if end < 0:
                return False
            self._buf = self._buf[end + 1:]
            self._new_call(name, events)
            self._in_block += 1
            self._state = "fence"
            return True
        if state == "args":
            used, done = self._args.feed(self._buf)
            if used:
                self._arguments(self._buf[:used], events)
                self._buf = self._buf[used:]
            if done:
                self._state = "fence_close"
            return done
        # "next": another call, or the block's end
        for literal, nxt in ((fmt.call_begin, "function"), (fmt.end, None)):
            at = match_literal(self._buf, 0, literal)
            if at == NEED:
                return False
            if at != MISMATCH:
                self._buf = self._buf[at:]
                if nxt is None:
                    self._to_text()
                else:
                    self._state = nxt
                return True
        self._to_text()  # neither: the rest is text
        return True

    def _mismatch(self, events: list[ToolEvent]) -> bool:
        """Markup that stopped matching: given back before the block's first call, else the
        block ends and the rest is text."""
        if self._in_block == 0:
            self._give_back(events)
        else:
            self._to_text()
        return True

    def _finish_call(self, events: list[ToolEvent]) -> None:
        if self._in_block == 0:
            super()._finish_call(events)
            return
        self._buf = ""  # cut inside a call: its arguments stay as far as they came
        self._to_text()


def deepseek_root(fmt: DeepSeekFormat, functions: list[tuple[str, dict[str, Any]]],
                  one: bool, at_least_one: bool, special: dict[str, int],
                  max_whitespace: int) -> dict[str, Any]:
    """The structural tag's root for ``functions`` (``special``: marker text -> its token id
    where it is one special token)."""

    def marker(text: str) -> Any:
        token = special.get(text)
        return text if token is None else {"type": "token", "token": token}

    def element(text: str) -> dict[str, Any]:
        token = special.get(text)
        if token is None:
            return {"type": "const_string", "value": text}
        return {"type": "token", "token": token}

    bodies = [{"type": "sequence", "elements": [
        {"type": "const_string", "value": "function"}, element(fmt.sep),
        {"type": "const_string", "value": f"{name}\n{_FENCE_OPEN}\n"},
        {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": max_whitespace},
        {"type": "const_string", "value": f"\n{_FENCE_CLOSE}"}]}
        for name, parameters in functions]
    call = {"type": "tag", "begin": marker(fmt.call_begin),
            "content": bodies[0] if len(bodies) == 1 else {"type": "or", "elements": bodies},
            "end": marker(fmt.call_end)}
    calls = {"type": "tags_with_separator", "tags": [call], "separator": fmt.separator,
             "at_least_one": True, "stop_after_first": one}
    block = {"type": "tag", "begin": marker(fmt.begin), "content": calls, "end": marker(fmt.end)}
    if at_least_one:
        return block
    if fmt.begin in special:
        return {"type": "token_triggered_tags", "trigger_tokens": [special[fmt.begin]],
                "tags": [block], "at_least_one": False, "stop_after_first": True}
    return {"type": "triggered_tags", "triggers": [fmt.begin], "tags": [block],
            "at_least_one": False, "stop_after_first": True}
