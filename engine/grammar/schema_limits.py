"""JSON Schema keywords that no grammar backend here enforces, found before anything compiles.

A token grammar describes a context-free language; some JSON Schema keywords constrain relations
between parts of an instance that such a grammar does not express (or that the backends do not
implement). Both backends compile schemas that use them and then *accept instances that break
them* — measured with xgrammar 0.2.9 and outlines-core 0.2.14 on the default tokenizer
(tests/grammar/test_schema_limits.py keeps that measurement honest):

- ``uniqueItems: true``, ``contains`` / ``minContains`` / ``maxContains`` (arrays),
- ``dependentRequired``, ``dependentSchemas``, draft-7 ``dependencies`` (objects),
- ``not``, ``if`` / ``then`` / ``else``, ``allOf`` (only one branch is applied),
- ``oneOf`` (applied as ``anyOf``; harmless when its branches cannot overlap, see
  :func:`_exclusive_branches`),
- ``unevaluatedProperties`` other than ``true`` / ``{}`` (``unevaluatedItems: false`` after
  ``prefixItems`` is enforced).

OpenAI's ``response_format.json_schema.strict: true`` promises outputs that follow the schema, so
the server refuses such a schema up front (HTTP 400 naming each keyword and where it sits) rather
than serve outputs that may not validate. Without ``strict`` the schema is served best effort.
"""

from __future__ import annotations

from typing import Any

# keyword -> the value that makes it a no-op (None: every value constrains)
UNENFORCED_KEYWORDS: dict[str, Any] = {
    "uniqueItems": False,
    "contains": None,
    "minContains": None,
    "maxContains": None,
    "dependentRequired": None,
    "dependentSchemas": None,
    "dependencies": None,
    "not": None,
    "if": None,
    "allOf": None,
    "oneOf": None,
    "unevaluatedProperties": True,
}

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unenforced_keywords(schema: Any) -> list[str]:
    """Where ``schema`` uses a keyword the grammar would not enforce.

    Args:
        schema: a parsed JSON Schema (dict or bool).

    Returns:
        ``"keyword at /json/pointer"`` strings in document order; empty when the grammar enforces
        everything the schema says. Property names are never mistaken for keywords.
    """
    found: list[str] = []
    _walk(schema, "", found)
    return found


def _walk(schema: Any, path: str, found: list[str]) -> None:
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in UNENFORCED_KEYWORDS and not _is_noop(key, value):
            found.append(f"{key} at {path or '/'}")
        if key in _ONE and isinstance(value, dict):
            _walk(value, f"{path}/{key}", found)
        elif key in _LIST and isinstance(value, list):
            for i, sub in enumerate(value):
                _walk(sub, f"{path}/{key}/{i}", found)
        elif key in _MAP and isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, f"{path}/{key}/{_escape(name)}", found)


def _is_noop(key: str, value: Any) -> bool:
    if key == "oneOf":
        return _exclusive_branches(value)
    noop = UNENFORCED_KEYWORDS[key]
    if noop is None:
        return False
    return value == noop or (noop is True and value == {})


def _exclusive_branches(branches: Any) -> bool:
    """True if no instance can match two ``oneOf`` branches, so ``anyOf`` means the same.

    Recognised: every branch a ``const``, all different; or every branch one JSON ``type``, all
    different ("integer" and "number" overlap).
    """
    if not isinstance(branches, list) or not all(isinstance(b, dict) for b in branches):
        return False
    if all("const" in b for b in branches):
        consts = [repr(b["const"]) for b in branches]
        return len(set(consts)) == len(consts)
    types = [b.get("type") for b in branches]
    if not all(isinstance(t, str) for t in types):
        return False
    kinds = ["number" if t == "integer" else t for t in types]
    return len(set(kinds)) == len(kinds)


def _escape(name: str) -> str:
    """RFC 6901 pointer token."""
    return name.replace("~", "~0").replace("/", "~1")
