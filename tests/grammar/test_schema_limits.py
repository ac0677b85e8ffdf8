"""The keywords schema_limits calls unenforced really are (xgrammar accepts an instance that
breaks each), the ones it leaves out really are enforced, and the walk finds them where they are.

If an xgrammar upgrade starts enforcing a listed keyword, ``test_listed_keywords_are_not_enforced``
fails: drop the keyword from ``UNENFORCED_KEYWORDS`` (strict schemas with it become servable).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from grammar_cases import matcher_accepts

from splitserve.engine.grammar import BaseGrammarBackend
from splitserve.engine.grammar.schema_limits import UNENFORCED_KEYWORDS, unenforced_keywords
from splitserve.server.constraints import constraint_from_request
from splitserve.server.errors import APIError
from splitserve.server.protocol import ChatCompletionRequest

# keyword -> (schema using it, an instance valid except for that keyword)
BROKEN_BY: dict[str, tuple[dict, Any]] = {
    "uniqueItems": ({"type": "array", "uniqueItems": True}, [1, 1]),
    "contains": ({"type": "array", "contains": {"type": "string"}}, [1]),
    "minContains": ({"type": "array", "contains": {"type": "string"}, "minContains": 2}, ["a", 1]),
    "maxContains": (
        {"type": "array", "contains": {"type": "string"}, "maxContains": 1},
        ["a", "b"],
    ),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "dependentSchemas": (
        {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
        {"a": 1},
    ),
    "dependencies": ({"type": "object", "dependencies": {"a": ["b"]}}, {"a": 1}),
    "not": ({"not": {"type": "integer"}}, 1),
    "if": ({"if": {"type": "integer"}, "then": {"minimum": 5}}, 1),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, 1),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, 3),
    "unevaluatedProperties": (
        {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
        {"b": 1},
    ),
}
# Keywords left off the list, each with an instance that breaks only it: xgrammar refuses these.
ENFORCED: dict[str, tuple[dict, Any]] = {
    "minLength": ({"type": "string", "minLength": 3}, "ab"),
    "pattern": ({"type": "string", "pattern": "^[a-z]+$"}, "A1"),
    "format": ({"type": "string", "format": "date"}, "2020-13-45x"),
    "minimum": ({"type": "integer", "minimum": 5}, 3),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, 4),
    "maxItems": ({"type": "array", "maxItems": 1}, [1, 2]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}]}, [1]),
    "required": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {},
    ),
    "additionalProperties": (
        {"type": "object", "properties": {"a": {}}, "additionalProperties": False},
        {"b": 1},
    ),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
        {"x": "s"},
    ),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 2}}, {"abc": 1}),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "s"),
    "enum": ({"enum": [1, 2]}, 3),
    "unevaluatedItems": ({"type": "array", "prefixItems": [{}], "unevaluatedItems": False}, [1, 2]),
    "$ref": ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}, "s"),
}


def _accepts(backend: BaseGrammarBackend, tokenizer: Any, schema: dict, instance: Any) -> bool:
    compiled = backend.compile("json_schema", json.dumps(schema))
    ids = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
    return matcher_accepts(compiled.create_matcher(), ids, tokenizer.eos_token_id)


def test_every_listed_keyword_has_a_case() -> None:
    assert set(BROKEN_BY) == set(UNENFORCED_KEYWORDS)


@pytest.mark.parametrize("keyword", sorted(BROKEN_BY))
def test_listed_keywords_are_not_enforced(xgrammar_backend, tokenizer, keyword: str) -> None:
    schema, instance = BROKEN_BY[keyword]
    assert _accepts(xgrammar_backend, tokenizer, schema, instance)
    assert f"{keyword} at /" in unenforced_keywords(schema)


@pytest.mark.parametrize("keyword", sorted(ENFORCED))
def test_other_keywords_are_enforced(xgrammar_backend, tokenizer, keyword: str) -> None:
    schema, instance = ENFORCED[keyword]
    assert not _accepts(xgrammar_backend, tokenizer, schema, instance)
    assert unenforced_keywords(schema) == []


def test_walk_reports_paths_and_skips_property_names_and_noops() -> None:
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "string"},  # a property called "not", not the keyword
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "a/b": {"not": {"const": 1}},
            "flags": {"type": "array", "uniqueItems": False},
        },
        "$defs": {"x": {"anyOf": [{"if": {"type": "integer"}}]}},
        "unevaluatedProperties": {},
        "enum": [{"not": 1}],  # data, not a schema
    }
    assert unenforced_keywords(schema) == [
        "uniqueItems at /properties/tags",
        "not at /properties/a~1b",
        "if at /$defs/x/anyOf/0",
    ]


def test_one_of_with_disjoint_branches_is_enforced() -> None:
    assert unenforced_keywords({"oneOf": [{"type": "string"}, {"type": "integer"}]}) == []
    assert unenforced_keywords({"oneOf": [{"const": "a"}, {"const": "b"}]}) == []
    assert unenforced_keywords({"oneOf": [{"type": "integer"}, {"type": "number"}]}) == [
        "oneOf at /"
    ]


def _chat(schema: dict, strict: bool | None) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": strict},
            },
        }
    )


def test_strict_refuses_unenforceable_schema_and_non_strict_serves_it() -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(APIError, match="uniqueItems at /") as info:
        constraint_from_request(_chat(schema, strict=True))
    assert info.value.param == "response_format"
    for strict in (False, None):
        constraint = constraint_from_request(_chat(schema, strict))
        assert constraint is not None and json.loads(constraint.text) == schema
    ok = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert constraint_from_request(_chat(ok, strict=True)) is not None
