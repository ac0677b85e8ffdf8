"""A chat request's tool fields, checked together, as what the job needs: the tools to render,
the grammar that enforces the calls, and the format to parse them in.

Follows OpenAI's Chat Completions semantics: ``tool_choice`` defaults to ``auto`` when ``tools``
are given; ``none`` means no call (the tools are then left out of the prompt too, so a model
trained for tools is not invited to write a call we would not parse); ``required`` and a named
function need tools; ``parallel_tool_calls`` defaults to true.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.constraints.schema_limits import ignored_keywords, known_refusals
from splitserve.ipc.messages import Constraint
from splitserve.server.errors import APIError
from splitserve.server.protocol import ChatCompletionRequest, NamedToolChoice
from splitserve.server.tools.formats import PythonicFormat, ToolCallFormat
from splitserve.server.tools.grammar import ANY_OBJECT, FunctionSpec, tool_call_constraint
from splitserve.server.tools.pythonic_grammar import unenforced as pythonic_unenforced


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What one request's tools change.

    Attributes:
        tools: the ``tools[]`` entries to render into the prompt (None: none).
        constraint: the call grammar (None: tools are off for this answer).
        format: the envelope the answer is parsed in (None: the answer is plain content).
        functions: name -> ``parameters`` schema of every function in ``tools`` (the XML and
            pythonic parsers read them).
    """

    tools: list[dict[str, Any]] | None
    constraint: Constraint | None
    format: ToolCallFormat | None
    functions: dict[str, dict[str, Any]] | None = None


NO_TOOLS = ToolRequest(None, None, None)


def tool_request(req: ChatCompletionRequest, fmt: ToolCallFormat,
                 begin_token: int | None = None,
                 special: dict[str, int] | None = None) -> ToolRequest:
    """The tool side of ``req`` for a model writing calls in ``fmt`` (``begin_token``,
    ``special``: its markers that are special tokens, ``server.tools.grammar``).

    Raises:
        APIError: ``tool_choice`` required or named without ``tools``, a named function
            that is not in ``tools``, duplicate names, a ``strict`` function whose schema uses
            keywords the grammar cannot enforce, or another constraint field together with
            active tools (each a 400 naming the field).
    """
    tools = req.tools or []
    choice = req.tool_choice
    names = [t.function.name for t in tools]
    if not tools:
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            raise APIError("tool_choice: a function must be called, but no tools are given",
                           param="tool_choice")
        return NO_TOOLS
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(f"tools: the function name {dup!r} appears twice", param="tools")
    for i, tool in enumerate(tools):
        if tool.function.strict and tool.function.parameters is not None:
            _refuse_unenforceable(fmt, tool.function.parameters,
                                  f"tools[{i}].function.parameters")
    if choice == "none":
        return NO_TOOLS
    functions = [FunctionSpec(t.function.name, t.function.parameters or ANY_OBJECT)
                 for t in tools]
    mode = "auto"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(f"tool_choice: the function {choice.function.name!r} is not in tools",
                           param="tool_choice")
        functions = [f for f in functions if f.name == choice.function.name]
        mode = "named"
    elif choice == "required":
        mode = "required"
    _refuse_second_constraint(req)
    parallel = req.parallel_tool_calls is not False
    constraint = tool_call_constraint(fmt, functions, mode, parallel,  # type: ignore[arg-type]
                                      begin_token, special)
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    schemas = {t.function.name: t.function.parameters or ANY_OBJECT for t in tools}
    return ToolRequest(rendered, constraint, fmt, schemas)


def _refuse_unenforceable(fmt: ToolCallFormat, schema: dict[str, Any], param: str) -> None:
    # Tool calls compile as xgrammar structural tags (constraints.chain routes them there):
    # its measured limits (constraints.schema_limits) say what it would not enforce; a
    # pythonic call's arguments are our own EBNF (server.tools.pythonic_grammar).
    if isinstance(fmt, PythonicFormat):
        unenforced = pythonic_unenforced(schema)
    else:
        unenforced = ignored_keywords("xgrammar", schema) + known_refusals("xgrammar", schema)
    if unenforced:
        raise APIError(
            f"{param}: the function is strict, but the grammar cannot enforce "
            f"{'; '.join(unenforced)}: remove these keywords or set strict to false "
            "(then they are not enforced)",
            param=param,
        )


def _refuse_second_constraint(req: ChatCompletionRequest) -> None:
    """One grammar per request: the call grammar leaves no room for a second constraint."""
    fmt = req.response_format
    others = [name for name, on in (
        ("response_format", fmt is not None and fmt.type != "text"),
        ("regex", req.regex is not None), ("ebnf", req.ebnf is not None),
        ("choice", req.choice is not None)) if on]
    if others:
        raise APIError(f"{others[0]}: cannot be combined with tools unless tool_choice is "
                       "'none' (one constraint per request)", param=others[0])
