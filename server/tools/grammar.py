"""The tool-call envelope as a grammar: a structural tag (xgrammar's format) built from the tools.

The grammar layer decodes under it, on the prefill worker (first token) and the decode worker
alike, so every call's name is one of the tools and its arguments follow that function's
``parameters`` schema:

- ``auto``: free text, and wherever the model starts a call (the format's marker, or a bare
  ``{"name": `` where the format allows one) the rest of that call is constrained
  (``triggered_tags``); after the call, text again, or another call.
- ``required``: the answer is calls only, at least one, separated by the format's separator
  (``tags_with_separator``).
- a named function: exactly one call, of that function.
- ``parallel_tool_calls: false``: at most one call (``stop_after_first``): the answer ends
  after it.

Each family's calls: the JSON families' here; Qwen3-Coder's XML (``server.tools.xml_calls``,
xgrammar's ``qwen_xml`` style), pythonic lists (``server.tools.pythonic_grammar``, EBNF) and
DeepSeek-V3's blocks (``server.tools.deepseek_calls``) in the same shapes.

Reference: xgrammar 0.2.9's structural tag formats (``xgrammar/structural_tag.py``:
``triggered_tags``, ``token_triggered_tags``, ``tags_with_separator``, ``tag``,
``json_schema``); the text is built here from plain dicts, so the API server does not import
xgrammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from splitserve.ipc.messages import Constraint
from splitserve.server.tools.deepseek_calls import deepseek_root
from splitserve.server.tools.formats import (
    DeepSeekFormat,
    PythonicFormat,
    ToolCallFormat,
    XmlCallFormat,
)
from splitserve.server.tools.pythonic_grammar import call_list_grammar, rest_of_list_grammar
from splitserve.server.tools.xml_calls import xml_call_tag

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a function without ``parameters``
MAX_WHITESPACE = 20  # in a row inside arguments, as the JSON-schema grammar allows (xgrammar)
BARE_TRIGGER = '{"name": '

ToolMode = Literal["auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """A function the model may call: its name and the JSON Schema of its arguments."""

    name: str
    parameters: dict[str, Any]


def tool_call_constraint(
    fmt: ToolCallFormat,
    functions: list[FunctionSpec],
    mode: ToolMode,
    parallel: bool,
    begin_token: int | None = None,
    special: dict[str, int] | None = None,
) -> Constraint:
    """The ``structural_tag`` constraint that lets the model call only ``functions``.

    Args:
        fmt: the envelope the model writes.
        functions: the callable functions (for ``named``: just that one).
        mode: ``auto`` (text or calls), ``required`` (calls only, at least one) or ``named``
            (exactly one call).
        parallel: more than one call allowed (``required``/``auto``).
        begin_token: the id of ``fmt.begin`` where it is a special token (Mistral's
            ``[TOOL_CALLS]``), which no text spells; None where the marker is text.
        special: every marker of ``fmt`` that is one special token -> its id (DeepSeek's).

    Returns:
        ``Constraint("structural_tag", json)``.

    Raises:
        ValueError: no functions.
    """
    if not functions:
        raise ValueError("a tool-call grammar needs at least one function")
    one = mode == "named" or not parallel
    at_least_one = mode != "auto"
    if fmt.family == "json":
        root = _json_root(fmt, functions, one, at_least_one, begin_token)
    elif isinstance(fmt, XmlCallFormat):
        tags = [xml_call_tag(fmt, f.name, f.parameters, MAX_WHITESPACE) for f in functions]
        root = _tags_root(tags, fmt.begin, fmt.separator, one, at_least_one)
    elif isinstance(fmt, PythonicFormat):
        root = _pythonic_root(functions, one, at_least_one)
    elif isinstance(fmt, DeepSeekFormat):
        pairs = [(f.name, f.parameters) for f in functions]
        if special is None and begin_token is not None:
            special = {fmt.begin: begin_token}
        root = deepseek_root(fmt, pairs, one, at_least_one, special or {}, MAX_WHITESPACE)
    else:
        raise ValueError(f"no grammar for the tool-call format {fmt.name!r}")
    text = json.dumps({"type": "structural_tag", "format": root}, ensure_ascii=False)
    return Constraint("structural_tag", text)


def _json_root(fmt: ToolCallFormat, functions: list[FunctionSpec], one: bool,
               at_least_one: bool, begin_token: int | None) -> dict[str, Any]:
    """The JSON families (Hermes, Llama 3 JSON, Mistral)."""
    if fmt.in_list:
        body = _list_tag(fmt, functions, one, begin_token)
        if begin_token is not None:
            root = {"type": "token_triggered_tags", "trigger_tokens": [begin_token],
                    "tags": [body], "at_least_one": at_least_one, "stop_after_first": True}
        else:
            root = {"type": "triggered_tags", "triggers": [fmt.begin], "tags": [body],
                    "at_least_one": at_least_one, "stop_after_first": True}
    else:
        tags, triggers = [], []
        if fmt.begin:
            tags += [_tagged_call(fmt, f) for f in functions]
            triggers.append(fmt.begin)
        if fmt.bare_calls or not fmt.begin:
            tags += [_call(fmt, f) for f in functions]
            triggers.append(BARE_TRIGGER)
        if at_least_one:  # calls only, from the first token to the end
            root = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
                    "at_least_one": True, "stop_after_first": one}
        else:
            root = {"type": "triggered_tags", "triggers": triggers, "tags": tags,
                    "at_least_one": False, "stop_after_first": one}
    return root


def _tags_root(tags: list[dict[str, Any]], trigger: str, separator: str, one: bool,
               at_least_one: bool) -> dict[str, Any]:
    """Tags that all begin with ``trigger``: calls only (``at_least_one``), or free text with
    calls wherever the trigger is written."""
    if at_least_one:
        return {"type": "tags_with_separator", "tags": tags, "separator": separator,
                "at_least_one": True, "stop_after_first": one}
    return {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
            "at_least_one": False, "stop_after_first": one}


def _pythonic_root(functions: list[FunctionSpec], one: bool,
                   at_least_one: bool) -> dict[str, Any]:
    """A pythonic call list: the whole answer (``at_least_one``), or, under ``auto``, free text
    in which ``[NAME(`` starts a list (of calls only, up to its ``]``)."""
    pairs = [(f.name, f.parameters) for f in functions]
    if at_least_one:
        return {"type": "grammar", "grammar": call_list_grammar(pairs, one)}
    tags = [{"type": "tag", "begin": f"[{f.name}(",
             "content": {"type": "grammar", "grammar": rest_of_list_grammar(pairs, i, one)},
             "end": "]"} for i, f in enumerate(functions)]
    return {"type": "triggered_tags", "triggers": [f"[{f.name}(" for f in functions],
            "tags": tags, "at_least_one": False, "stop_after_first": True}


def _arguments(function: FunctionSpec) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": function.parameters,
            "max_whitespace_cnt": MAX_WHITESPACE}


def _call(fmt: ToolCallFormat, function: FunctionSpec) -> dict[str, Any]:
    """A call object with no marker: ``{"name": "N", "arguments": A}``."""
    return {"type": "tag", "begin": fmt.header(function.name), "content": _arguments(function),
            "end": "}"}


def _tagged_call(fmt: ToolCallFormat, function: FunctionSpec) -> dict[str, Any]:
    """``<begin>\\n{"name": "N", "arguments": A}\\n<end>``, as ``render_calls`` writes it."""
    return {"type": "tag", "begin": f"{fmt.begin}\n{fmt.header(function.name)}",
            "content": _arguments(function), "end": f"}}\n{fmt.end}"}


def _list_tag(fmt: ToolCallFormat, functions: list[FunctionSpec], one: bool,
              begin_token: int | None) -> dict[str, Any]:
    """Mistral's ``[TOOL_CALLS][call, call, ...]``."""
    calls = {"type": "tags_with_separator", "tags": [_call(fmt, f) for f in functions],
             "separator": ", ", "at_least_one": True, "stop_after_first": one}
    begin: Any = fmt.begin if begin_token is None else {"type": "token", "token": begin_token}
    content = {"type": "sequence", "elements": [{"type": "const_string", "value": "["}, calls]}
    return {"type": "tag", "begin": begin, "content": content, "end": "]"}
