"""One answer's tool-call parser for a format, and the whole answer parsed at once.

Every parser implements ``server.tools.events.BaseToolCallParser``; which one reads a format is
its ``family``: the JSON families (``server.tools.extract``), Qwen3-Coder's XML
(``server.tools.xml_calls``), pythonic lists (``server.tools.pythonic_calls``) and DeepSeek-V3's
blocks (``server.tools.deepseek_calls``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from splitserve.server.tools.calls import ToolCall, new_call_id
from splitserve.server.tools.deepseek_calls import DeepSeekCallParser
from splitserve.server.tools.events import BaseToolCallParser
from splitserve.server.tools.extract import ToolCallExtractor
from splitserve.server.tools.formats import (
    DeepSeekFormat,
    PythonicFormat,
    ToolCallFormat,
    XmlCallFormat,
)
from splitserve.server.tools.pythonic_calls import PythonicCallParser
from splitserve.server.tools.xml_calls import XmlCallParser


def create_parser(fmt: ToolCallFormat, functions: dict[str, dict[str, Any]] | None = None,
                  call_ids: Callable[[], str] | None = None) -> BaseToolCallParser:
    """A fresh parser of one answer in ``fmt``.

    Args:
        fmt: the envelope the model writes.
        functions: name -> ``parameters`` schema of the request's functions (the XML format
            reads values by it; a pythonic list starts only at one of these names).
        call_ids: makes each call's ``id`` (default: :func:`new_call_id` for ``fmt``).
    """
    functions = functions or {}
    ids = call_ids or (lambda: new_call_id(fmt.id_length))
    if isinstance(fmt, XmlCallFormat):
        return XmlCallParser(fmt, functions, ids)
    if isinstance(fmt, PythonicFormat):
        return PythonicCallParser(fmt, functions, ids)
    if isinstance(fmt, DeepSeekFormat):
        return DeepSeekCallParser(fmt, ids)
    return ToolCallExtractor(fmt, ids)


def parse_tool_calls(text: str, fmt: ToolCallFormat,
                     call_ids: Callable[[], str] | None = None,
                     functions: dict[str, dict[str, Any]] | None = None,
                     cut: bool = False) -> tuple[str, list[ToolCall]]:
    """The whole answer's ``(content, calls)``, exactly what streaming it would deliver
    (``cut``: ``max_tokens`` ended it, see ``BaseToolCallParser.finish``)."""
    parser = create_parser(fmt, functions, call_ids)
    events = parser.feed(text) + parser.finish(cut)
    content = "".join(e.content for e in events if e.content is not None)
    return content, parser.calls
