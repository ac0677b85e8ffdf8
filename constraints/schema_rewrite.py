"""Exact rewrites of a JSON schema into keywords the grammar backends enforce.

Each rewrite keeps the set of valid instances unchanged (as judged by the validator class
``jsonschema.validators.validator_for`` picks for the schema, which is what the server's safety
net checks outputs with); it only spells a constraint in keywords a backend can turn into a
grammar. The chain (``chain.plan_chain``) measures and compiles the rewritten schema; outputs are
still validated against the schema the request sent.

- ``oneOf`` whose branches are provably pairwise disjoint becomes ``anyOf`` (for disjoint
  branches "exactly one" and "at least one" agree). Disjoint means: no JSON type in common
  (``integer`` inside ``number``), or objects only, separated by a required property pinned to
  disjoint ``const``/``enum`` values (a discriminator). Local ``$ref`` s are followed.
- ``oneOf`` of branches that only list one or more ``required`` names becomes ``anyOf`` of
  ``{"type": "object", "required": R_i, "properties": {p: false}}`` for every single-name
  ``R_j`` (j != i): branch i holds and no other does. (Every such branch holds for a non-object,
  so with two or more branches ``oneOf`` refuses non-objects; ``"type": "object"`` keeps that.)
- ``dependencies`` (drafts 4-7), ``dependentRequired`` and ``dependentSchemas`` (2019-09 on)
  become ``allOf`` entries ``anyOf: [{"properties": {name: false}}, <what the name requires>]``:
  the name is absent, or its dependency holds. This one is exact where the schema's draft has
  the keyword, and stricter (never looser) where it does not: a schema without ``$schema`` is
  read as 2020-12, which dropped ``dependencies``, yet its author meant it.
- A ``format`` outside the JSON Schema specification's list is dropped: the validator treats it
  as an annotation, and backends refuse names they do not know.

A schema that uses ``unevaluatedProperties`` or ``unevaluatedItems`` anywhere is left alone:
those read the annotations of sibling subschemas, which moving a keyword into ``anyOf`` changes.

Reference: JSON Schema 2020-12 Core and Validation (sections on ``oneOf``, ``dependentRequired``,
``dependentSchemas``, ``format`` as annotation), and draft-07's ``dependencies``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import jsonschema

# JSON Schema 2020-12 Validation section 7.3, plus draft-04's names that later drafts renamed.
STANDARD_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
    "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
    "json-pointer", "relative-json-pointer", "regex", "host-name", "ip-address",
})
# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("not", "if", "then", "else", "items", "additionalItems", "additionalProperties",
        "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas",
        "dependencies")
_ALL_TYPES = frozenset({"null", "boolean", "object", "array", "string", "int", "frac"})
_TYPE_ATOMS = {
    "null": {"null"}, "boolean": {"boolean"}, "object": {"object"}, "array": {"array"},
    "string": {"string"}, "integer": {"int"}, "number": {"int", "frac"},
}
_MAX_DEPTH = 32  # $ref chains followed while proving disjointness
_MODERN = (jsonschema.Draft201909Validator, jsonschema.Draft202012Validator)


def exact_rewrite(schema: Any) -> Any:
    """Rewrite ``schema`` (parsed JSON) as described in the module docstring.

    Args:
        schema: a JSON schema (dict or bool); not modified.

    Returns:
        A schema with the same valid instances; ``schema`` itself when nothing applies.
    """
    if not isinstance(schema, dict) or _mentions_unevaluated(schema):
        return schema
    validator = jsonschema.validators.validator_for(
        schema, default=jsonschema.Draft202012Validator)
    rewritten = copy.deepcopy(schema)
    # Before 2019-09 a "$ref" replaces its siblings: facts are taken from the target alone.
    context = _Context(rewritten, legacy_ref=validator not in _MODERN)
    changed = False
    for node in list(_schema_nodes(rewritten)):
        changed |= _rewrite_node(node, context)
    return rewritten if changed else schema


def exact_rewrite_text(text: str) -> str:
    """``exact_rewrite`` on JSON text; text that is not a JSON object comes back unchanged."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    rewritten = exact_rewrite(schema)
    return text if rewritten is schema else json.dumps(rewritten)


def _mentions_unevaluated(node: Any) -> bool:
    """Returns: True if a key ``unevaluatedProperties``/``unevaluatedItems`` occurs anywhere."""
    if isinstance(node, dict):
        return any(k in ("unevaluatedProperties", "unevaluatedItems") or _mentions_unevaluated(v)
                   for k, v in node.items())
    if isinstance(node, list):
        return any(_mentions_unevaluated(v) for v in node)
    return False


def _schema_nodes(node: Any) -> Iterator[dict[str, Any]]:
    """Yields: every subschema (dict) of ``node``, children before parents."""
    if not isinstance(node, dict):
        return
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield from _schema_nodes(node[key])
    for key in _LIST:
        if isinstance(node.get(key), list):
            for child in node[key]:
                yield from _schema_nodes(child)
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for child in node[key].values():
                yield from _schema_nodes(child)
    yield node


class _Context:
    """The schema being rewritten and how its ``$ref`` s read."""

    def __init__(self, root: dict[str, Any], legacy_ref: bool) -> None:
        self.root = root
        self.legacy_ref = legacy_ref

    def parts(self, node: dict[str, Any]) -> list[Any]:
        """Returns: the schemas that must all hold for ``node``: itself (unless a legacy
        ``$ref`` hides it), its ``$ref`` target and its ``allOf`` parts."""
        target = _resolve(node["$ref"], self.root) if "$ref" in node else None
        if "$ref" in node and self.legacy_ref:
            return [target]
        parts: list[Any] = [{k: v for k, v in node.items() if k not in ("$ref", "allOf")}]
        if target is not None:
            parts.append(target)
        if isinstance(node.get("allOf"), list):
            parts.extend(node["allOf"])
        return parts


def _rewrite_node(node: dict[str, Any], context: _Context) -> bool:
    """Apply every rewrite to one subschema in place. Returns: True if it changed."""
    changed = False
    if isinstance(node.get("format"), str) and node["format"] not in STANDARD_FORMATS:
        del node["format"]
        changed = True
    branches = node.get("oneOf")
    if isinstance(branches, list) and branches:
        replacement = _disjoint_any_of(branches, context)
        if replacement is not None:
            del node["oneOf"]
            _add_all_of(node, {"anyOf": replacement})
            changed = True
    for keyword in ("dependencies", "dependentRequired", "dependentSchemas"):
        if isinstance(node.get(keyword), dict):
            clauses = _dependency_clauses(node[keyword])
            if clauses is not None:
                del node[keyword]
                for clause in clauses:
                    _add_all_of(node, clause)
                changed = True
    return changed


def _add_all_of(node: dict[str, Any], clause: dict[str, Any]) -> None:
    """AND ``clause`` into ``node``: as its ``anyOf`` when it has none, else into ``allOf``."""
    if set(clause) == {"anyOf"} and "anyOf" not in node:
        node["anyOf"] = clause["anyOf"]
    else:
        node.setdefault("allOf", []).append(clause)


def _dependency_clauses(dependencies: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Returns: one ``anyOf`` clause per dependency, or None for a form not recognised."""
    clauses = []
    for name, needs in dependencies.items():
        absent = {"properties": {name: False}}
        if isinstance(needs, list) and all(isinstance(n, str) for n in needs):
            present: Any = {"required": list(needs)}
        elif isinstance(needs, (dict, bool)):
            present = needs
        else:
            return None
        clauses.append({"anyOf": [absent, present]})
    return clauses


def _disjoint_any_of(branches: list[Any], context: _Context) -> list[Any] | None:
    """Returns: an ``anyOf`` list equal to ``oneOf: branches``, or None when not proven."""
    required_only = _required_only(branches)
    if required_only is not None:
        return required_only
    facts = [_Facts.of(branch, context) for branch in branches]
    for i, left in enumerate(facts):
        for right in facts[i + 1:]:
            if not left.disjoint(right):
                return None
    return list(branches)


def _required_only(branches: list[Any]) -> list[Any] | None:
    """The ``oneOf: [{"required": [...]}, ...]`` form, rewritten; None for any other form."""
    if len(branches) < 2:
        return None
    names = []
    for branch in branches:
        if not (isinstance(branch, dict) and set(branch) == {"required"}
                and isinstance(branch["required"], list) and branch["required"]
                and all(isinstance(n, str) for n in branch["required"])):
            return None
        names.append(branch["required"])
    rewritten = []
    for i, own in enumerate(names):
        others = [other for j, other in enumerate(names) if j != i]
        if any(len(other) != 1 for other in others):
            return None  # "not all of several names" is itself a disjunction: not spelled here
        rewritten.append({"type": "object", "required": list(own),
                          "properties": {other[0]: False for other in others}})
    return rewritten


class _Facts:
    """What one branch is known to admit: JSON types (None: any) and pinned properties."""

    def __init__(self, types: frozenset[str] | None, pins: dict[str, frozenset[str]]) -> None:
        self.types = types
        self.pins = pins  # required property -> the canonical JSON of every value allowed

    @classmethod
    def of(cls, branch: Any, context: _Context) -> _Facts:
        """Returns: the facts proven for ``branch`` (nothing proven: any type, no pins)."""
        return cls(_types(branch, context, 0), _pins(branch, context, 0))

    def disjoint(self, other: _Facts) -> bool:
        """Returns: True when no instance can satisfy both branches."""
        mine = _ALL_TYPES if self.types is None else self.types
        theirs = _ALL_TYPES if other.types is None else other.types
        common = mine & theirs
        if not common:
            return True
        if common != {"object"}:
            return False
        return any(name in other.pins and not (values & other.pins[name])
                   for name, values in self.pins.items())


def _resolve(ref: Any, root: dict[str, Any]) -> Any:
    """Returns: the target of a local ``$ref`` ("#" or "#/json/pointer"), or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _types(node: Any, context: _Context, depth: int) -> frozenset[str] | None:
    """Returns: the JSON types ``node`` may admit (a superset), or None when not known."""
    if node is False:
        return frozenset()
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return None
    if "$ref" in node or "allOf" in node:
        found = [_types(part, context, depth + 1) for part in context.parts(node)]
        return _intersect([f for f in found if f is not None])
    known: list[frozenset[str]] = []
    declared = node.get("type")
    if isinstance(declared, str):
        declared = [declared]
    if isinstance(declared, list):
        atoms: set[str] = set()
        for name in declared:
            if name not in _TYPE_ATOMS:
                return None
            atoms |= _TYPE_ATOMS[name]
        known.append(frozenset(atoms))
    if "const" in node:
        known.append(frozenset({_value_type(node["const"])}))
    if isinstance(node.get("enum"), list):
        known.append(frozenset(_value_type(v) for v in node["enum"]))
    for keyword in ("anyOf", "oneOf"):
        branches = node.get(keyword)
        if isinstance(branches, list) and branches:
            found = [_types(branch, context, depth + 1) for branch in branches]
            if all(f is not None for f in found):
                known.append(frozenset().union(*found))  # type: ignore[arg-type]
    return _intersect(known)


def _pins(node: Any, context: _Context, depth: int) -> dict[str, frozenset[str]]:
    """Returns: required properties of ``node`` whose value is limited to a known set."""
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return {}
    if "$ref" in node or "allOf" in node:
        required: set[str] = set()
        values: dict[str, frozenset[str]] = {}
        for part in context.parts(node):
            if not isinstance(part, dict):
                continue
            if isinstance(part.get("required"), list):
                required |= {n for n in part["required"] if isinstance(n, str)}
            for name, allowed in _property_values(part, context, depth).items():
                values[name] = values[name] & allowed if name in values else allowed
            for name, allowed in _pins(part, context, depth + 1).items():
                required.add(name)
                values[name] = values[name] & allowed if name in values else allowed
        return {name: allowed for name, allowed in values.items() if name in required}
    required = {n for n in node.get("required", []) if isinstance(n, str)} \
        if isinstance(node.get("required"), list) else set()
    return {name: allowed for name, allowed in _property_values(node, context, depth).items()
            if name in required}


def _property_values(
    node: dict[str, Any], context: _Context, depth: int
) -> dict[str, frozenset[str]]:
    """Returns: per property of ``node.properties`` limited to known values, those values."""
    properties = node.get("properties")
    if not isinstance(properties, dict):
        return {}
    limited = {}
    for name, schema in properties.items():
        allowed = _allowed_values(schema, context, depth + 1)
        if allowed is not None:
            limited[name] = allowed
    return limited


def _allowed_values(node: Any, context: _Context, depth: int) -> frozenset[str] | None:
    """Returns: the canonical JSON of every value ``node`` allows, or None when unlimited."""
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return None
    if "$ref" in node or "allOf" in node:
        found = [_allowed_values(part, context, depth + 1) for part in context.parts(node)]
        return _intersect([f for f in found if f is not None])
    found = []
    if "const" in node:
        found.append(frozenset({_canonical(node["const"])}))
    if isinstance(node.get("enum"), list):
        found.append(frozenset(_canonical(v) for v in node["enum"]))
    return _intersect(found)


def _intersect(sets: list[frozenset[str]]) -> frozenset[str] | None:
    """Returns: the intersection of ``sets``, or None (nothing known) when there are none."""
    if not sets:
        return None
    result = sets[0]
    for other in sets[1:]:
        result &= other
    return result


def _value_type(value: Any) -> str:
    """Returns: the type atom of a JSON value (``int`` for integral numbers, as JSON Schema)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "int"
    if isinstance(value, float):
        return "frac"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _canonical(value: Any) -> str:
    """Returns: one spelling per JSON value (1 and 1.0 are equal in JSON Schema)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value, sort_keys=True)
