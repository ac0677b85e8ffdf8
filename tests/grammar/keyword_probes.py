"""Probes for every schema feature of ``schema_limits`` (draft 2020-12 keywords, draft 7's
``dependencies`` / ``additionalItems`` / tuple ``items``, and the combinations backends are known
to mishandle): per feature, schemas using it, each with an instance that is valid except for
that feature (``jsonschema`` says invalid; every other keyword of the schema holds).

A backend *enforces* a probe when it compiles the schema and its matcher refuses the instance;
it *refuses* it when the compile fails. test_schema_limits.py measures every probe on every
backend against ``schema_limits.BACKEND_LIMITS``.
"""

from __future__ import annotations

from typing import Any

DRAFT7 = "http://json-schema.org/draft-07/schema#"

# feature -> [(schema, instance that breaks only that feature)]
PROBES: dict[str, list[tuple[Any, Any]]] = {
    "type": [({"type": "integer"}, "s"), ({"type": "object"}, [1])],
    "type_list": [({"type": ["string", "null"]}, 1)],
    "enum": [({"enum": [1, "a", {"b": 2}]}, 2), ({"enum": [{"b": 2}]}, {"b": 3})],
    "const": [({"const": {"a": [1, 2]}}, {"a": [1]})],
    "multipleOf": [({"type": "integer", "multipleOf": 3}, 4)],
    "multipleOf_number": [({"type": "number", "multipleOf": 0.5}, 0.3),
                          ({"type": "integer", "multipleOf": 1.5}, 4)],
    "maximum": [({"type": "integer", "maximum": 9}, 12)],
    "minimum": [({"type": "integer", "minimum": 3}, -1), ({"type": "integer", "minimum": 3}, 1)],
    "exclusiveMaximum": [({"type": "integer", "exclusiveMaximum": 5}, 5)],
    "exclusiveMinimum": [({"type": "integer", "exclusiveMinimum": 5}, 5)],
    "maximum_number": [({"type": "number", "maximum": 1.5}, 1.75)],
    "minimum_number": [({"type": "number", "minimum": 1.5}, 1.25)],
    "exclusiveMaximum_number": [({"type": "number", "exclusiveMaximum": 1}, 1)],
    "exclusiveMinimum_number": [({"type": "number", "exclusiveMinimum": 0}, 0)],
    "bounds_untyped": [({"minimum": 5}, 3), ({"maximum": 5}, 7)],
    "maxLength": [({"type": "string", "maxLength": 2}, "abc")],
    "minLength": [({"type": "string", "minLength": 3}, "ab")],
    "length_untyped": [({"maxLength": 2}, "abc"), ({"minLength": 2}, "a")],
    "pattern": [({"type": "string", "pattern": "^a+$"}, ""),
                ({"type": "string", "pattern": "[0-9]"}, "ab")],
    "pattern_untyped": [({"pattern": "^a+$"}, "b")],
    "maxLength_with_pattern": [({"type": "string", "pattern": "^a+$", "maxLength": 2}, "aaa")],
    "minLength_with_pattern": [({"type": "string", "pattern": "^a+$", "minLength": 3}, "aa")],
    "maxLength_with_format": [
        ({"type": "string", "format": "email", "maxLength": 5}, "ab@cd.ef"),
    ],
    "maxItems": [({"type": "array", "maxItems": 1}, [1, 2])],
    "minItems": [({"type": "array", "minItems": 2}, [1])],
    "items": [({"type": "array", "items": {"type": "integer"}}, [1, "a"])],
    "items_false": [({"type": "array", "items": False}, [1])],
    "items_tuple": [({"$schema": DRAFT7, "type": "array", "items": [{"type": "integer"}]}, ["a"])],
    "additionalItems": [
        ({"$schema": DRAFT7, "type": "array", "items": [{}], "additionalItems": False}, [1, 2]),
    ],
    "prefixItems": [({"type": "array", "prefixItems": [{"type": "string"}]}, [1])],
    "items_after_prefixItems": [
        ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}},
         [1, 2]),
    ],
    "array_untyped": [({"items": {"type": "integer"}}, ["a"]), ({"maxItems": 1}, [1, 2])],
    "uniqueItems": [({"type": "array", "uniqueItems": True}, [1, 1])],
    "contains": [({"type": "array", "contains": {"type": "string"}}, [1])],
    "minContains": [({"type": "array", "contains": {"type": "string"}, "minContains": 2},
                     ["a", 1])],
    "maxContains": [({"type": "array", "contains": {"type": "string"}, "maxContains": 1},
                     ["a", "b"])],
    "unevaluatedItems": [({"type": "array", "prefixItems": [{}], "unevaluatedItems": False},
                          [1, 2])],
    "maxProperties": [({"type": "object", "maxProperties": 1}, {"a": 1, "b": 2})],
    "minProperties": [({"type": "object", "minProperties": 1}, {})],
    "required": [({"type": "object", "properties": {"a": {"type": "integer"}},
                   "required": ["a"]}, {})],
    "properties": [({"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": "x"})],
    "properties_false": [({"type": "object", "properties": {"a": False}}, {"a": 1})],
    "additionalProperties": [
        ({"type": "object", "properties": {"a": {}}, "additionalProperties": False}, {"b": 1}),
    ],
    "additionalProperties_schema": [
        ({"type": "object", "additionalProperties": {"type": "integer"}}, {"b": "x"}),
    ],
    "patternProperties": [
        ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, {"x": "s"}),
    ],
    "additionalProperties_with_patternProperties": [
        ({"type": "object", "patternProperties": {"^x": {}}, "additionalProperties": False},
         {"y": 1}),
    ],
    "object_untyped": [({"properties": {"a": {"type": "integer"}}}, {"a": "x"}),
                       ({"required": ["a"]}, {})],
    "propertyNames": [({"type": "object", "propertyNames": {"maxLength": 2}}, {"abc": 1}),
                      ({"type": "object", "propertyNames": False}, {"a": 1}),
                      ({"type": "object", "propertyNames": {"const": "a"}}, {"b": 1}),
                      ({"type": "object", "propertyNames": {"enum": ["a", "b"]}}, {"c": 1})],
    "dependentRequired": [({"type": "object", "dependentRequired": {"a": ["b"]}}, {"a": 1})],
    "dependentSchemas": [({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
                          {"a": 1})],
    "dependencies": [({"$schema": DRAFT7, "type": "object", "dependencies": {"a": ["b"]}},
                      {"a": 1})],
    "unevaluatedProperties": [
        ({"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False}, {"b": 1}),
    ],
    "anyOf": [({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "s")],
    "oneOf": [({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, 3)],
    "oneOf_exclusive": [({"oneOf": [{"type": "integer"}, {"type": "string"}]}, True)],
    "allOf": [({"allOf": [{"type": "integer"}, {"minimum": 2}]}, 1),
              ({"allOf": [{"type": "object", "required": ["a"]},
                          {"type": "object", "required": ["b"]}]}, {"a": 1})],
    "not": [({"not": {"type": "integer"}}, 1)],
    "if": [({"if": {"type": "integer"}, "then": {"minimum": 5}}, 1)],
    "$ref": [({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}, "s"),
             ({"$defs": {"n": {"type": "object",
                               "properties": {"c": {"$ref": "#/$defs/n"},
                                              "v": {"type": "integer"}}}},
               "$ref": "#/$defs/n"}, {"c": {"c": {"v": "x"}}})],
    "$ref_anchor": [({"$defs": {"a": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"}, "s")],
    "$ref_external": [({"$id": "http://example.com/root", "$ref": "http://example.com/item",
                        "$defs": {"i": {"$id": "http://example.com/item", "type": "integer"}}},
                       "a"),
                      ({"$ref": "https://json-schema.org/draft/2020-12/schema"},
                       {"type": 1})],
    "$ref_sibling": [({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "minimum": 5},
                      3)],
    "$dynamicRef": [({"$dynamicAnchor": "n", "type": "object",
                      "properties": {"c": {"$dynamicRef": "#n"}, "v": {"type": "integer"}}},
                     {"c": {"v": "x"}})],
}
