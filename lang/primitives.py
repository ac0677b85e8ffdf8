"""The expressions a program appends: ``gen``, ``select`` and the role wrappers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from splitserve.lang.ir import ConstantText, Gen, Node, RoleBegin, RoleEnd, Select, Seq, flatten


def gen(
    name: str | None = None,
    *,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: dict[str, Any] | str | None = None,
    choices: list[str] | None = None,
    grammar: str | None = None,
    dtype: type | None = None,
    tools: list[dict[str, Any] | Callable[..., Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    reasoning: bool = False,
    reasoning_effort: str | None = None,
) -> Gen:
    """A generation step; its text is appended and stored in ``s[name]``.

    Args:
        name: variable to capture the output in (``None``: append only).
        max_tokens: at most this many new tokens (default: the run's, else 128).
        stop: string(s) that end the generation; not included in the output.
        temperature, top_p, seed: sampling (default: the run's, else the server's).
        regex: the output matches this regular expression.
        json_schema: the output is JSON valid under this schema (dict or JSON text).
        choices: the output is exactly one of these strings.
        grammar: the output is a sentence of this EBNF grammar, in llama.cpp's GBNF syntax with
            a ``root`` rule (what the server's ``ebnf`` field takes); e.g.
            :func:`splitserve.lang.sql.sql_grammar` for SQL over a database's schema.
        dtype: ``int``, ``float`` or ``bool`` constrain the output to a literal of that type
            and store the parsed value; ``str`` (default) stores the text.
        tools: functions the model may call: OpenAI function spec dicts
            (``{"type": "function", "function": {...}}``) or Python functions with type hints
            (their docstring describes them). The gen must open an assistant message; it goes
            to the chat endpoint, ``s[name]`` is the text outside the calls and
            ``s.tool_calls(name)`` the calls (:class:`~splitserve.lang.tool_calls.ToolCall`).
        tool_choice: ``"auto"`` (default), ``"none"``, ``"required"``, or a tool's name (that
            function must be called).
        parallel_tool_calls: False: at most one call.
        reasoning: a reasoning model's thinking is kept apart from its answer: the gen must
            open an assistant message and goes to the chat endpoint; ``s[name]`` is the answer
            and ``s.reasoning(name)`` the thinking (the server's ``reasoning_content``; None
            where the server splits none off).
        reasoning_effort: OpenAI's effort level (``low``, ``medium``, ``high``...), sent with
            a ``reasoning`` gen: a thinking budget on a splitserve server.

    Raises:
        ValueError: more than one constraint (tools count as one), an unsupported ``dtype``,
            an empty ``grammar``, a bad tool, or a ``tool_choice`` without tools or naming no tool.
    """
    from splitserve.lang.constraints import check_one_constraint

    if grammar is not None and (not isinstance(grammar, str) or not grammar.strip()):
        raise ValueError("gen grammar must be GBNF text with a root rule, e.g. "
                         "'root ::= \"yes\" | \"no\"'")
    from splitserve.lang.tool_spec import tool_choice_field, tool_spec

    specs = [tool_spec(t) for t in tools] if tools is not None else None
    if specs is None and (tool_choice is not None or parallel_tool_calls is not None):
        raise ValueError("tool_choice and parallel_tool_calls need tools=[...]")
    if specs is not None:
        tool_choice = tool_choice_field(tool_choice, [s["function"]["name"] for s in specs])
    if reasoning_effort is not None and not reasoning:
        raise ValueError("reasoning_effort needs reasoning=True")

    node = Gen(
        name=name,
        max_tokens=max_tokens,
        stop=[stop] if isinstance(stop, str) else stop,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        regex=regex,
        json_schema=json_schema,
        choices=list(choices) if choices is not None else None,
        grammar=grammar,
        dtype=dtype,
        tools=specs,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        reasoning=reasoning,
        reasoning_effort=reasoning_effort,
    )
    check_one_constraint(node)
    return node


def select(name: str | None, choices: list[str]) -> Select:
    """Append whichever of ``choices`` the model scores highest (mean logprob of the choice's
    tokens given the prompt) and store it in ``s[name]``; the scores are in ``s.meta(name)``.

    Raises:
        ValueError: ``choices`` is empty or holds a non-string.
    """
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select needs a non-empty list of strings")
    return Select(name, list(choices))


def _role(role: str, content: Any) -> Seq:
    return Seq([RoleBegin(role), *flatten(content), RoleEnd(role)])


def system(content: Any = "") -> Seq:
    """A system message holding ``content`` (text, gen, or a sum of them)."""
    return _role("system", content)


def user(content: Any = "") -> Seq:
    """A user message holding ``content``."""
    return _role("user", content)


def assistant(content: Any = "") -> Seq:
    """An assistant message holding ``content``; usually ``assistant(gen("answer"))``."""
    return _role("assistant", content)


def tool(content: Any, call: Any) -> Seq:
    """A ``tool`` message: the result of ``call`` (a :class:`~splitserve.lang.tool_calls.ToolCall`
    or its id) fed back to the model. ``content`` is text; any other value (a dict, a number)
    is sent as its JSON.

    Raises:
        TypeError: ``call`` is neither a ToolCall nor a string id; ``content`` is not JSON.
    """
    import json

    call_id = call if isinstance(call, str) else getattr(call, "id", None)
    if not isinstance(call_id, str):
        raise TypeError(f"tool() answers a ToolCall or its id, not {type(call).__name__}")
    if not isinstance(content, (str, Node)):
        content = ConstantText(json.dumps(content, ensure_ascii=False))
    return Seq([RoleBegin("tool", call_id), *flatten(content), RoleEnd("tool")])
