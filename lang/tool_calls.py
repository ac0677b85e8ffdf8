"""Tool calls as a program sees them: parsed from OpenAI's ``message.tool_calls``, kept in the
assistant turn of the history, and run against the program's Python functions."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitserve.lang.errors import BackendError


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made.

    Attributes:
        id: the call's id; the tool turn that answers it names it (``lang.tool(result, call)``).
        name: the function's name.
        arguments: the arguments, parsed from the JSON text the server returned.
        arguments_json: that JSON text, as returned (sent back verbatim in the history).
    """

    id: str
    name: str
    arguments: dict[str, Any]
    arguments_json: str

    def as_openai(self) -> dict[str, Any]:
        """The entry of an assistant message's ``tool_calls`` (OpenAI Chat Completions)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}

    def invoke(self, tools: list[Any]) -> Any:
        """Call the Python function among ``tools`` named ``self.name`` with the arguments.

        Raises:
            LookupError: no Python function of that name is in ``tools`` (spec dicts have no
                code to run).
        """
        funcs: dict[str, Callable[..., Any]] = {
            t.__name__: t for t in tools if callable(t) and hasattr(t, "__name__")}
        if self.name not in funcs:
            raise LookupError(f"no Python function named {self.name!r} among the tools "
                              f"(have: {sorted(funcs)})")
        return funcs[self.name](**self.arguments)


def parse_tool_calls(raw: list[dict[str, Any]] | None) -> list[ToolCall]:
    """``choices[0].message.tool_calls`` of a chat completion, as :class:`ToolCall` s.

    Raises:
        BackendError: an entry is not a function call, or its arguments are not a JSON object
            (an unconstrained server may produce that; it is an error, not an empty dict).
    """
    calls = []
    for i, entry in enumerate(raw or []):
        fn = entry.get("function") or {}
        if entry.get("type", "function") != "function" or "name" not in fn:
            raise BackendError(f"tool_calls[{i}] is not a function call: {entry!r}")
        text = fn.get("arguments") or "{}"
        try:
            args = json.loads(text)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise BackendError(f"tool_calls[{i}] ({fn['name']}): the arguments are not a JSON "
                               f"object: {text[:200]!r}")
        calls.append(ToolCall(entry.get("id") or f"call_{i}", fn["name"], args, text))
    return calls
