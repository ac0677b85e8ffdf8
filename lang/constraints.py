"""What ``gen``'s ``dtype`` and ``choices`` compile to, and how outputs are parsed back."""

from __future__ import annotations

from typing import Any

from splitserve.lang.ir import Gen

# Literals as Python would parse them; short enough that a small model cannot run away in them.
DTYPE_REGEX: dict[type, str] = {
    int: r"-?(0|[1-9][0-9]{0,17})",
    float: r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,10})?",
    bool: r"(True|False)",
}


def check_one_constraint(node: Gen) -> None:
    """Raises ValueError when ``node`` asks for two constraints or an unknown ``dtype``."""
    if node.dtype not in (None, str, *DTYPE_REGEX):
        raise ValueError(f"gen dtype must be int, float, bool or str, not {node.dtype!r}")
    kinds = [k for k in ("regex", "json_schema", "choices", "grammar")
             if getattr(node, k) is not None]
    if node.dtype in DTYPE_REGEX:
        kinds.append("dtype")
    if node.tools is not None and node.tool_choice != "none":
        kinds.append("tools")  # the call grammar is the request's one constraint
    if len(kinds) > 1:
        raise ValueError(f"gen takes one constraint, got {' and '.join(kinds)}")


def constraint_of(node: Gen) -> tuple[str, Any] | None:
    """``(kind, value)`` with kind ``regex``, ``json_schema``, ``choices`` or ``grammar``
    (GBNF text); None if free."""
    if node.regex is not None:
        return "regex", node.regex
    if node.dtype in DTYPE_REGEX:
        return "regex", DTYPE_REGEX[node.dtype]
    if node.json_schema is not None:
        return "json_schema", node.json_schema
    if node.choices is not None:
        return "choices", node.choices
    if node.grammar is not None:
        return "grammar", node.grammar
    return None


def parse_output(node: Gen, text: str) -> Any:
    """The value stored for ``node``: the text, or it parsed as ``node.dtype``.

    Raises:
        ValueError: the text is not a literal of ``dtype`` (the server did not constrain it).
    """
    if node.dtype is bool:
        if text.strip() not in ("True", "False"):
            raise ValueError(f"expected True or False, got {text!r}")
        return text.strip() == "True"
    if node.dtype in (int, float):
        try:
            return node.dtype(text.strip())
        except ValueError:
            raise ValueError(f"expected {node.dtype.__name__}, got {text!r}") from None
    return text
