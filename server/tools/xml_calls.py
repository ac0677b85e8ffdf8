"""Qwen3-Coder's XML tool calls: the parser, and the grammar that enforces them.

The model writes::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text for a string and JSON for anything else; the parser turns each
into its JSON value by the function's ``parameters`` schema (a string property stays text, an
integer is parsed as one, ...; one newline on each side of the value is layout, not value) and
streams the arguments as a JSON object, one fragment per finished parameter: ``{"city":
"Paris"``, then ``, "days": 3``, then ``}``. A bare ``<function=...>`` without the
``<tool_call>`` wrapper is read as a call too (vLLM's parser does the same).

The grammar is xgrammar's structural tag with the ``qwen_xml`` JSON-schema style (the
arguments' keys, order and value types held to the schema), in the shapes of the JSON families
(``server.tools.grammar``).

Reference: Qwen3-Coder's chat template and vLLM's ``qwen3coder_tool_parser.py`` (value
conversion); xgrammar ``builtin_structural_tag.get_qwen_3_5_structural_tag``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from splitserve.server.tools.events import ToolEvent
from splitserve.server.tools.formats import XmlCallFormat
from splitserve.server.tools.markup import MarkupCallParser
from splitserve.server.tools.scan import MISMATCH, NEED, WS, match_literal, skip_ws

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_FUNCTION_END = "</function>"
_PARAMETER_END = "</parameter>"


class XmlCallParser(MarkupCallParser):
    """Content and calls of one answer in Qwen3-Coder's format.

    Args:
        fmt: the format (its markers).
        functions: name -> the function's ``parameters`` schema (how each value is read).
        call_ids: makes each call's ``id``.
    """

    def __init__(self, fmt: XmlCallFormat, functions: dict[str, dict[str, Any]],
                 call_ids: Callable[[], str] | None = None) -> None:
        super().__init__([fmt.begin, fmt.function_prefix], fmt.separator, call_ids)
        self.fmt = fmt
        self.functions = functions
        self._state = ""
        self._tagged = False
        self._key = ""
        self._params = 0  # parameters of the current call so far

    def _begin(self, trigger: str) -> None:
        self._tagged = trigger == self.fmt.begin
        self._state = "open" if self._tagged else "name"

    def _call_step(self, events: list[ToolEvent]) -> bool:
        state, buf = self._state, self._buf
        if state == "open":  # after <tool_call>: <function=
            at = match_literal(buf, 0, self.fmt.function_prefix)
            if at == NEED:
                return False
            if at == MISMATCH:
                self._give_back(events)
                return True
            self._consume(at)
            self._state = "name"
            return True
        if state == "name":  # NAME>
            end = buf.find(">")
            name = buf[:end] if end >= 0 else buf
            if name and not _NAME.fullmatch(name) or end < 0 and len(buf) > 64:
                self._give_back(events)
                return True
            if end < 0:
                return False
            if not name:
                self._give_back(events)
                return True
            self._buf = buf[end + 1:]
            self._new_call(name, events)
            self._params, self._state = 0, "params"
            return True
        if state == "params":
            return self._params_step(events)
        if state == "key":  # KEY>
            end = buf.find(">")
            if end < 0:
                if "\n" in buf or "<" in buf:
                    return self._close_call(events)
                return False
            self._key, self._buf = buf[:end], buf[end + 1:]
            self._state = "value"
            return True
        if state == "value":  # VALUE</parameter>
            end = buf.find(_PARAMETER_END)
            if end < 0:
                return False
            value = self._value(self._key, buf[:end])
            sep = ", " if self._params else "{"
            self._arguments(f"{sep}{json.dumps(self._key, ensure_ascii=False)}: {value}", events)
            self._params += 1
            self._buf = buf[end + len(_PARAMETER_END):]
            self._state = "params"
            return True
        # "close": after </function>, the wrapper's </tool_call>
        at = match_literal(buf, 0, self.fmt.end)
        if at == NEED:
            return False
        if at != MISMATCH:
            self._buf = buf[at:]
        self._to_text()
        return True

    def _params_step(self, events: list[ToolEvent]) -> bool:
        buf = self._buf
        i = skip_ws(buf, 0)
        rest = buf[i:]
        if not rest:
            return False
        if rest.startswith(self.fmt.parameter_prefix):
            self._buf = rest[len(self.fmt.parameter_prefix):]
            self._state = "key"
            return True
        if rest.startswith(_FUNCTION_END):
            self._buf = rest[len(_FUNCTION_END):]
            self._arguments("}" if self._params else "{}", events)
            if self._tagged:
                self._state = "close"
            else:
                self._to_text()
            return True
        if self.fmt.parameter_prefix.startswith(rest) or _FUNCTION_END.startswith(rest):
            return False
        return self._close_call(events)

    def _close_call(self, events: list[ToolEvent]) -> bool:
        """Markup that is no parameter inside a call (a model writing on its own): the call
        ends there, and the rest is text."""
        self._arguments("}" if self._params else "{}", events)
        self._to_text()
        return True

    def _finish_call(self, events: list[ToolEvent]) -> None:
        if self._state in ("open", "name"):
            super()._finish_call(events)
            return
        self._buf = ""  # cut inside the call: its arguments stay as far as they came
        self._to_text()

    def _value(self, key: str, raw: str) -> str:
        """A parameter's raw text as JSON text, read by its schema."""
        raw = raw.removeprefix("\n")
        raw = raw.removesuffix("\n")
        schema = (self.functions.get(self.calls[-1].name) or {}).get("properties", {}).get(key)
        return json.dumps(xml_value(raw, schema), ensure_ascii=False)


def xml_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """The JSON value of a parameter written as ``raw`` text, for the property ``schema``
    (None: unknown): a string type keeps the text; integer, number, boolean, null, object and
    array parse it (as JSON; the text itself where that fails); no type: JSON if it parses."""
    types = _types(schema)
    if "string" in types:
        return raw
    text = raw.strip(WS)
    if "integer" in types and re.fullmatch(r"-?\d+", text):
        return int(text)
    if types & {"number", "integer", "boolean", "null", "object", "array"} or not types:
        try:
            return json.loads(text)
        except ValueError:
            return raw
    return raw


def _types(schema: dict[str, Any] | None) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return {"string"}
    if "const" in schema and isinstance(schema["const"], str):
        return {"string"}
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            out |= _types(branch)
    return out


def xml_call_tag(fmt: XmlCallFormat, name: str, parameters: dict[str, Any],
                 max_whitespace: int) -> dict[str, Any]:
    """One call as an xgrammar tag: ``<tool_call>\\n<function=N>\\n`` + the parameters in the
    ``qwen_xml`` style + ``\\n</function>\\n</tool_call>``."""
    return {"type": "tag", "begin": f"{fmt.begin}\n{fmt.function_prefix}{name}>\n",
            "content": {"type": "json_schema", "json_schema": parameters, "style": "qwen_xml",
                        "max_whitespace_cnt": max_whitespace},
            "end": f"\n{_FUNCTION_END}\n{fmt.end}"}
