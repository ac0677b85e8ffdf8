"""``gen(tools=...)``'s arguments in OpenAI's form: a tool given as a spec dict is checked, one
given as a Python function becomes a spec (its JSON schema built by pydantic from the type
hints, its description from the docstring); ``tool_choice`` is normalized."""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_ARG_LINE = re.compile(r"^\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


def tool_spec(tool: dict[str, Any] | Callable[..., Any]) -> dict[str, Any]:
    """``{"type": "function", "function": {name, description, parameters}}`` for ``tool``.

    Raises:
        ValueError: a dict that is not a function spec, a bad name, or a function with a
            parameter that has no type hint or is ``*args``/``**kwargs``.
        TypeError: neither a dict nor a function.
    """
    if isinstance(tool, dict):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError('a tool dict must be {"type": "function", "function": {"name": '
                             f'..., "parameters": {{...}}}}}}, got {tool!r}')
        _check_name(fn.get("name"))
        return tool
    if callable(tool):
        return {"type": "function", "function": function_spec(tool)}
    raise TypeError(f"a tool is an OpenAI function spec dict or a Python function, not "
                    f"{type(tool).__name__}")


def function_spec(func: Callable[..., Any]) -> dict[str, Any]:
    """The ``function`` object for a Python function (see :func:`tool_spec`)."""
    import pydantic

    _check_name(func.__name__)
    hints = typing.get_type_hints(func, include_extras=True)
    doc = inspect.getdoc(func) or ""
    arg_docs = _arg_descriptions(doc)
    fields: dict[str, Any] = {}
    for name, param in inspect.signature(func).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(f"tool {func.__name__}: *{name} has no JSON schema; list the "
                             "parameters")
        if name not in hints:
            raise ValueError(f"tool {func.__name__}: parameter {name!r} needs a type hint "
                             "(it becomes the argument's JSON schema)")
        default = ... if param.default is param.empty else param.default
        fields[name] = (hints[name], pydantic.Field(default, description=arg_docs.get(name)))
    model = pydantic.create_model(func.__name__, **fields)
    spec: dict[str, Any] = {"name": func.__name__, "parameters": _untitled(
        model.model_json_schema())}
    summary = doc.split("\n\n", 1)[0].strip()
    if summary:
        spec["description"] = summary
    return spec


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"a tool's name must match {_NAME.pattern}, got {name!r}")


def _arg_descriptions(doc: str) -> dict[str, str]:
    """``name: text`` lines of a Google-style ``Args:`` section."""
    out: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
        elif in_args and line and not line[0].isspace():
            in_args = False
        elif in_args and (m := _ARG_LINE.match(line)):
            out[m.group(1)] = m.group(2).strip()
    return out


def _untitled(schema: dict[str, Any]) -> dict[str, Any]:
    """pydantic's schema without its generated ``title`` keys (noise in the prompt)."""
    schema = {k: v for k, v in schema.items() if k != "title"}
    if isinstance(schema.get("properties"), dict):
        schema["properties"] = {k: _untitled(v) if isinstance(v, dict) else v
                                for k, v in schema["properties"].items()}
    return schema


def tool_choice_field(choice: str | dict[str, Any] | None,
                      names: list[str]) -> str | dict[str, Any] | None:
    """OpenAI's ``tool_choice`` for ``choice``: ``"auto"``, ``"none"``, ``"required"``, a
    function's name, or the named dict; None leaves it to the server (``auto``).

    Raises:
        ValueError: a name (or named dict) that is not one of ``names``.
    """
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
    else:
        name = choice
    if name not in names:
        raise ValueError(f"tool_choice {choice!r}: no tool named {name!r} (have: {names})")
    return {"type": "function", "function": {"name": name}}
