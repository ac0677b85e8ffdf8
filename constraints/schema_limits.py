"""Which JSON Schema keywords each grammar backend enforces, measured, found before anything
compiles: the table the backend chain (``chain.plan_chain``) routes by.

A schema is reduced to *features*: a keyword in the context that changes how backends treat it
(``maxLength`` next to ``pattern`` is ``maxLength_with_pattern``; ``minimum`` without ``type`` is
``minimum_untyped``; ``oneOf`` whose branches cannot overlap is ``oneOf_exclusive``). For each
backend, ``BACKEND_LIMITS`` records the features it *enforces* (compiles and refuses every
instance that breaks them) and those it *refuses* (a compile error: sound, only no coverage).
Every other feature counts as ignored: the table is an allowlist, so a keyword nobody measured is
never trusted. tests/grammar/test_schema_limits.py measures every feature on every backend with
one probe each (tests/grammar/keyword_probes.py) and fails when this table and the measurement
disagree, so an upgrade that changes a backend changes the table with it.

Annotations (``title``, ``description``, ``default``, ``examples``, ``format``, ``content*``,
``$comment``, ``deprecated``, ``readOnly``, ``writeOnly``) and unknown keywords produce no
feature: draft 2020-12 validators do not assert them either (``format`` is an annotation unless a
format-assertion vocabulary is declared).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class BackendLimits:
    """What one backend version does with each schema feature.

    Attributes:
        version: the package version the table was measured with.
        enforced: features the backend compiles and enforces.
        refused: features the backend refuses to compile (a ``GrammarError``).
        refuses_itself: the backend refuses what it does not implement on every schema (it names
            the keys), so a schema with a refused feature is still tried on it, not skipped: what
            it compiles, it enforces (llguidance: MaskBench's 0 accepted-invalid, and ours).
    """

    version: str
    enforced: frozenset[str]
    refused: frozenset[str] = frozenset()
    refuses_itself: bool = False


# Measured with the SmolLM2-135M tokenizer and compact JSON (tests/grammar/test_schema_limits.py).
BACKEND_LIMITS: dict[str, BackendLimits] = {
    "llguidance": BackendLimits(
        version="1.9.1",
        enforced=frozenset({
            "$ref", "$ref_anchor", "$ref_sibling", "additionalItems", "additionalProperties",
            "additionalProperties_schema", "additionalProperties_with_patternProperties", "allOf",
            "anyOf", "array_untyped", "bounds_untyped", "const", "enum", "exclusiveMaximum",
            "exclusiveMaximum_number", "exclusiveMinimum", "exclusiveMinimum_number", "items",
            "items_after_prefixItems", "items_false", "items_tuple", "length_untyped", "maxItems",
            "maxLength", "maxLength_with_format", "maxLength_with_pattern", "maxProperties",
            "maximum", "maximum_number", "minItems", "minLength", "minLength_with_pattern",
            "minProperties", "minimum", "minimum_number", "multipleOf", "multipleOf_number",
            "object_untyped", "oneOf_exclusive", "pattern", "patternProperties",
            "pattern_untyped", "prefixItems", "properties", "properties_false", "required",
            "type", "type_list",
        }),
        refused=frozenset({
            "$dynamicRef", "$ref_external", "contains", "dependencies", "dependentRequired", "dependentSchemas",
            "if", "maxContains", "minContains", "not", "oneOf", "propertyNames",
            "unevaluatedItems", "unevaluatedProperties", "uniqueItems",
        }),
        refuses_itself=True,
    ),
    "xgrammar": BackendLimits(
        version="0.2.9",
        enforced=frozenset({
            "$ref", "additionalProperties", "additionalProperties_schema",
            "additionalProperties_with_patternProperties", "anyOf", "const", "enum",
            "exclusiveMaximum", "exclusiveMaximum_number", "exclusiveMinimum",
            "exclusiveMinimum_number", "items", "items_after_prefixItems", "items_false",
            "maxItems", "maxLength", "maxProperties", "maximum", "maximum_number", "minItems",
            "minLength", "minProperties", "minimum", "minimum_number", "multipleOf",
            "oneOf_exclusive", "pattern", "patternProperties", "prefixItems", "properties",
            "required", "type", "type_list", "unevaluatedItems",
        }),
        # propertyNames: enforced for maxLength, refused for const/enum/false with a type,
        # ignored without one (JSON-Schema-Test-Suite propertyNames#4): never trusted.
        refused=frozenset({"additionalItems", "items_tuple", "properties_false", "propertyNames"}),
    ),
    # Refused here is often "regex too complex" (OutlinesBackend.max_regex_len), not the keyword.
    "outlines": BackendLimits(
        version="0.2.14",
        enforced=frozenset({
            "$ref", "additionalProperties_schema", "anyOf", "const", "enum", "items",
            "items_after_prefixItems", "maxItems", "maxLength", "maxLength_with_format",
            "maxLength_with_pattern", "maximum_number", "minItems", "minLength",
            "minLength_with_pattern", "minProperties", "minimum_number", "oneOf_exclusive",
            "pattern", "prefixItems", "properties", "required", "type", "type_list",
        }),
        refused=frozenset({
            "$dynamicRef", "additionalItems", "additionalProperties",
            "additionalProperties_with_patternProperties", "allOf", "array_untyped",
            "bounds_untyped", "if", "items_false", "items_tuple", "length_untyped", "not",
            "object_untyped", "oneOf", "pattern_untyped", "properties_false", "unevaluatedItems",
            "unevaluatedProperties",
        }),
    ),
}


def features(schema: Any) -> list[tuple[str, str, str]]:
    """The features ``schema`` uses, each with the keyword and where it sits.

    Args:
        schema: a parsed JSON Schema (dict or bool).

    Returns:
        ``(feature, keyword, json_pointer)`` triples in document order. Property names are
        never mistaken for keywords.
    """
    found: list[tuple[str, str, str]] = []
    _walk(schema, "", found)
    return found


def ignored_keywords(backend: str, schema: Any) -> list[str]:
    """Where ``backend`` would compile ``schema`` and not enforce it.

    Returns:
        ``"keyword at /json/pointer"`` strings; empty when the backend enforces all of it (or
        refuses what it does not). A backend missing from ``BACKEND_LIMITS`` enforces nothing.
    """
    limits = BACKEND_LIMITS.get(backend)
    out = []
    for feature, keyword, pointer in features(schema):
        if limits is None or (feature not in limits.enforced and feature not in limits.refused):
            out.append(f"{keyword} at {pointer or '/'}")
    return list(dict.fromkeys(out))


def known_refusals(backend: str, schema: Any) -> list[str]:
    """Returns: where ``backend`` refuses ``schema`` by the table, whether or not it
    ``refuses_itself``."""
    limits = BACKEND_LIMITS.get(backend)
    if limits is None:
        return []
    return [f"{k} at {p or '/'}" for f, k, p in features(schema) if f in limits.refused]


def refused_keywords(backend: str, schema: Any) -> list[str]:
    """Returns: where ``backend`` is known to refuse ``schema`` (it would fail to compile); empty
    for a backend that ``refuses_itself`` (it is tried and says so)."""
    limits = BACKEND_LIMITS.get(backend)
    if limits is None or limits.refuses_itself:
        return []
    return [f"{k} at {p or '/'}" for f, k, p in features(schema) if f in limits.refused]


# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalItems", "additionalProperties", "propertyNames", "contains", "not",
        "if", "then", "else", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_STRING = ("minLength", "maxLength", "pattern")
_ARRAY = ("maxItems", "minItems", "items", "prefixItems")
_OBJECT = ("maxProperties", "minProperties", "required", "properties", "additionalProperties",
           "patternProperties")
_PLAIN = ("enum", "const", "anyOf", "allOf", "not", "uniqueItems", "contains", "minContains",
          "maxContains", "unevaluatedItems", "propertyNames", "dependentRequired",
          "dependentSchemas", "dependencies", "additionalItems", "$dynamicRef",
          "$recursiveRef")
# Keywords that constrain an instance (beside ``$ref``, they make ``$ref_sibling``).
_VALIDATING = frozenset((*_BOUNDS, *_STRING, *_ARRAY, *_OBJECT, *_PLAIN, "type", "multipleOf",
                         "oneOf", "if", "unevaluatedProperties"))


def _feature(key: str, value: Any, schema: dict) -> str | None:
    """Returns: the feature of ``key`` in ``schema``, or None when it constrains nothing."""
    kind = schema.get("type")
    if key == "type":
        return "type_list" if isinstance(value, list) else "type"
    if key in _BOUNDS:
        if kind == "integer":
            return key
        return f"{key}_number" if kind == "number" else "bounds_untyped"
    if key == "multipleOf":
        return "multipleOf" if kind == "integer" and isinstance(value, int) else "multipleOf_number"
    if key in ("minLength", "maxLength"):
        if "pattern" in schema:
            return f"{key}_with_pattern"
        if "format" in schema:
            return "maxLength_with_format"
        return key if kind == "string" else "length_untyped"
    if key == "pattern":
        return key if kind == "string" else "pattern_untyped"
    if key == "uniqueItems" and value is False:
        return None
    if key == "unevaluatedProperties":
        return None if value in (True, {}) else key
    if key in ("items", "additionalProperties", "unevaluatedItems") and value in (True, {}):
        return None
    if key == "items" and value is False:
        return "items_false"
    if key == "items" and isinstance(value, list):
        return "items_tuple"  # draft 7's tuple form
    if key == "items" and "prefixItems" in schema:
        return "items_after_prefixItems"
    if key == "properties" and isinstance(value, dict) and any(v is False for v in value.values()):
        return "properties_false"
    if key == "additionalProperties":
        if "patternProperties" in schema:
            return "additionalProperties_with_patternProperties"
        return "additionalProperties" if value is False else "additionalProperties_schema"
    if key in _ARRAY:
        return key if kind == "array" else "array_untyped"
    if key in _OBJECT:
        return key if kind == "object" else "object_untyped"
    if key == "oneOf":
        return "oneOf_exclusive" if _exclusive_branches(value) else "oneOf"
    if key == "if":
        return "if"
    if key == "$ref":
        if not isinstance(value, str) or not value.startswith("#"):
            return "$ref_external"  # another document (by URI, or relative to an $id)
        if value != "#" and not value.startswith("#/"):
            return "$ref_anchor"  # a plain-name fragment: an $anchor / $dynamicAnchor
        return "$ref_sibling" if _VALIDATING.intersection(schema) else "$ref"
    if key in _PLAIN:
        return key
    return None


def _walk(schema: Any, path: str, found: list[tuple[str, str, str]]) -> None:
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        feature = _feature(key, value, schema)
        if feature is not None:
            found.append((feature, key, path))
        if key in _ONE and isinstance(value, dict):
            _walk(value, f"{path}/{key}", found)
        elif key in _LIST and isinstance(value, list):
            for i, sub in enumerate(value):
                _walk(sub, f"{path}/{key}/{i}", found)
        elif key in _MAP and isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, f"{path}/{key}/{_escape(name)}", found)


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
