"""Checks and rewrites of constraint sources shared by the backends.

Backends report errors in their own words (often a C++ file and line); these helpers produce the
message the API user sees, and turn ``choice`` lists into a regex or EBNF each backend can compile.
"""

from __future__ import annotations

import json
import re
from typing import Any

from splitserve.engine.grammar.base import GrammarError

JSON_OBJECT_SCHEMA = '{"type": "object"}'


def parse_json_schema(text: str) -> Any:
    """Parse a JSON Schema document.

    Args:
        text: the schema as JSON text.

    Returns:
        The parsed schema (a dict or a bool).

    Raises:
        GrammarError: if the text is not JSON, or not a JSON object/boolean.
    """
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"JSON schema syntax error: {exc}") from exc
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(
            f"JSON schema must be an object or a boolean, got {type(schema).__name__}"
        )
    return schema


def parse_choices(text: str) -> list[str]:
    """Parse a ``choice`` constraint: a JSON list of at least one string.

    Args:
        text: JSON text such as ``["yes", "no"]``.

    Returns:
        The choices, duplicates removed, order kept.

    Raises:
        GrammarError: if the text is not a non-empty JSON list of strings.
    """
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"choice must be a JSON list of strings: {exc}") from exc
    if not isinstance(choices, list) or not choices:
        raise GrammarError("choice must be a non-empty JSON list of strings")
    if not all(isinstance(c, str) for c in choices):
        raise GrammarError("choice must be a non-empty JSON list of strings")
    return list(dict.fromkeys(choices))


def choices_to_ebnf(choices: list[str]) -> str:
    """Returns: a GBNF grammar whose ``root`` matches exactly one of ``choices``."""
    # json.dumps gives a double-quoted literal with \" \\ \n \uXXXX escapes, which GBNF reads too.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def escape_regex_literal(text: str) -> str:
    r"""Escape ``text`` for a Rust ``regex`` pattern (outlines-core's dialect).

    Python's ``re.escape`` emits escapes such as ``\ `` that Rust rejects, so every character
    that is not a letter or digit becomes a ``\x{..}`` code point escape, which both accept.
    """
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def choices_to_regex(choices: list[str]) -> str:
    """Returns: a regex (Rust dialect) matching exactly one of ``choices``."""
    return "(" + "|".join(escape_regex_literal(c) for c in choices) + ")"


def regex_problem(pattern: str) -> str | None:
    """Ask Python's ``re`` what is wrong with a pattern, for a clearer message than a backend's.

    Returns:
        Python's description (e.g. ``unterminated character set at position 0``) or None if
        Python accepts the pattern (the dialects differ, so the backend's message then stands).
    """
    try:
        re.compile(pattern)
    except re.error as exc:
        return str(exc)
    return None


def clean_backend_message(message: str) -> str:
    """Drop the ``[time] /path/file.cc:123:`` prefix xgrammar puts on its C++ errors."""
    message = re.sub(r"^\s*\[[\d:]+\]\s*\S+\.(?:cc|h|cpp):\d+:\s*", "", message.strip())
    return message.replace("Check failed: (error.empty()) is false: ", "").strip()
