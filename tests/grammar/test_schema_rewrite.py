"""``schema_rewrite.exact_rewrite``: each rewrite on its own, and, as the independent check, the
``jsonschema`` verdict on every instance of JSON-Schema-Test-Suite draft2020-12 and of MaskBench
(tests/data) unchanged by the rewrite."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from grammar_cases import load_maskbench_cases, load_suite_cases

from splitserve.constraints.chain import plan_chain
from splitserve.constraints.schema_rewrite import exact_rewrite, exact_rewrite_text

BACKENDS = ["llguidance", "xgrammar", "outlines"]
DRAFT7 = "http://json-schema.org/draft-07/schema#"
DRAFT4 = "http://json-schema.org/draft-04/schema#"


def _valid(schema: Any, instance: Any) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(_no_bool_schemas(schema) if cls is jsonschema.Draft4Validator else schema
               ).is_valid(instance)


def _no_bool_schemas(node: Any) -> Any:
    """Draft 4 has no boolean subschemas: ``false`` spelled ``{"not": {}}`` for its validator."""
    if node is False:
        return {"not": {}}
    if node is True:
        return {}
    if isinstance(node, dict):
        return {k: v if k in ("enum", "const", "default", "required") else _no_bool_schemas(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_no_bool_schemas(v) for v in node]
    return node


def test_required_only_one_of_becomes_exclusive_any_of() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
              "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
    rewritten = exact_rewrite(schema)
    assert "oneOf" not in rewritten and len(rewritten["anyOf"]) == 2
    for instance in ({}, {"a": "x"}, {"b": "y"}, {"a": "x", "b": "y"}, [], "s", 3):
        assert _valid(rewritten, instance) == _valid(schema, instance), instance
    assert "oneOf" in schema  # the caller's schema is not modified


def test_required_only_with_several_names_is_left_alone() -> None:
    schema = {"oneOf": [{"required": ["a", "b"]}, {"required": ["c", "d"]}]}
    assert exact_rewrite(schema) is schema


def test_disjoint_types_through_refs() -> None:
    schema = {"$defs": {"when": {"type": "string", "format": "date-time"}},
              "properties": {"t": {"oneOf": [{"$ref": "#/$defs/when"}, {"type": "null"}]}}}
    rewritten = exact_rewrite(schema)
    assert "anyOf" in rewritten["properties"]["t"] and "oneOf" not in rewritten["properties"]["t"]


def test_integer_is_inside_number() -> None:
    schema = {"oneOf": [{"type": "integer"}, {"type": "number", "maximum": 3}]}
    assert exact_rewrite(schema) is schema  # 2 satisfies both: not disjoint


def test_discriminator_property() -> None:
    schema = {"oneOf": [
        {"type": "object", "required": ["kind"], "properties": {"kind": {"const": "a"}}},
        {"type": "object", "required": ["kind"], "properties": {"kind": {"enum": ["b", "c"]}}},
    ]}
    assert "anyOf" in exact_rewrite(schema)
    overlapping = {"oneOf": [
        {"type": "object", "required": ["kind"], "properties": {"kind": {"enum": ["a", "b"]}}},
        {"type": "object", "required": ["kind"], "properties": {"kind": {"enum": ["b", "c"]}}},
    ]}
    assert exact_rewrite(overlapping) is overlapping
    not_required = {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}}},
        {"type": "object", "properties": {"kind": {"const": "b"}}},
    ]}
    assert exact_rewrite(not_required) is not_required  # {} satisfies both


def test_legacy_ref_hides_its_siblings() -> None:
    branches = [{"$ref": "#/definitions/s", "type": "null"}, {"type": "string"}]
    modern = {"definitions": {"s": {"type": "string"}}, "oneOf": branches}
    # 2020-12: branch 0 is string AND null (nothing), disjoint from branch 1.
    assert "anyOf" in exact_rewrite(modern)
    # Draft 7: the sibling "type" is ignored, branch 0 is any string: both branches overlap.
    legacy = {"$schema": DRAFT7, **modern}
    assert exact_rewrite(legacy) is legacy


def test_dependencies_and_dependent_required() -> None:
    for schema in ({"$schema": DRAFT7, "dependencies": {"a": ["b"]}},
                   {"dependentRequired": {"a": ["b"]}},
                   {"$schema": DRAFT7, "dependencies": {"a": {"required": ["b"]}}},
                   {"dependentSchemas": {"a": {"required": ["b"]}}}):
        rewritten = exact_rewrite(schema)
        assert not {"dependencies", "dependentRequired", "dependentSchemas"} & set(rewritten)
        for instance in ({}, {"a": 1}, {"a": 1, "b": 2}, {"b": 2}, 5):
            assert _valid(rewritten, instance) == _valid(schema, instance), (schema, instance)


def test_dependencies_without_draft_is_enforced_as_written() -> None:
    # Read as 2020-12 the validator ignores "dependencies"; the grammar keeps its meaning
    # (stricter, never looser).
    schema = {"dependencies": {"a": ["b"]}}
    rewritten = exact_rewrite(schema)
    assert not _valid(rewritten, {"a": 1}) and _valid(schema, {"a": 1})
    assert _valid(rewritten, {"a": 1, "b": 2})


def test_unknown_format_dropped_known_kept() -> None:
    schema = {"properties": {"p": {"type": "string", "format": "expose"},
                             "q": {"type": "string", "format": "email"},
                             "format": {"type": "string"}}}
    rewritten = exact_rewrite(schema)
    assert "format" not in rewritten["properties"]["p"]
    assert rewritten["properties"]["q"]["format"] == "email"
    assert rewritten["properties"]["format"] == {"type": "string"}  # a property named "format"


def test_text_form_and_non_schemas() -> None:
    assert exact_rewrite_text("not json") == "not json"
    assert exact_rewrite(True) is True
    text = json.dumps({"type": "string"})
    assert exact_rewrite_text(text) is text


def test_package_configuration_schema_is_sound_after_rewrite() -> None:
    # The schema behind the non-strict violation of the 2026-12-02 CI preview: its top-level
    # oneOf of two "required" lists made every backend partial.
    from grammar_cases import DATA
    path = DATA / "jsonschemabench" / "schemas" / "JsonSchemaStore" / \
        "package-configuration-schema.json"
    plan = plan_chain("json_schema", path.read_text(), BACKENDS)
    assert plan.sound and plan.steps[0].backend == "llguidance" and not plan.steps[0].ignored


@pytest.mark.parametrize("load", [load_suite_cases, load_maskbench_cases],
                         ids=["suite", "maskbench"])
def test_verdicts_unchanged_on_every_instance(load: Any) -> None:
    rewritten_cases = checked = 0
    for case in load():
        schema = json.loads(case.schema_text)
        rewritten = exact_rewrite(schema)
        if rewritten is schema:
            continue
        rewritten_cases += 1
        for text in case.valid + case.invalid:
            instance = json.loads(text)
            assert _valid(rewritten, instance) == _valid(schema, instance), (case.name, text)
            checked += 1
    print(f"\n{load.__name__}: {rewritten_cases} schemas rewritten, {checked} verdicts equal")
    assert rewritten_cases > 0
