"""The measured keyword table (``schema_limits.BACKEND_LIMITS``) against a fresh measurement:
every feature probe (keyword_probes.py) on every backend, compact JSON, the default tokenizer.

A feature the table calls *enforced* must be refused in every probe; *refused* must fail to
compile (or be refused) in every probe; every other feature must be accepted somewhere (it is
ignored). An upgrade that changes a backend fails here: update its row from the message.
"""

from __future__ import annotations

import importlib.metadata
import json
from typing import Any

import jsonschema
import pytest
from grammar_cases import compact_json, matcher_accepts
from keyword_probes import PROBES

from splitserve.constraints.chain import plan_chain
from splitserve.constraints.schema_limits import (
    BACKEND_LIMITS,
    features,
    ignored_keywords,
)
from splitserve.engine.grammar import BaseGrammarBackend, GrammarError
from splitserve.server.constraints import constraint_from_request
from splitserve.server.errors import APIError
from splitserve.server.protocol import ChatCompletionRequest

PACKAGES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines": "outlines_core"}


def _measure(backend: BaseGrammarBackend, tokenizer: Any, feature: str) -> str:
    """Returns: "ignored" if some probe's breaking instance is accepted, else "refused" if some
    probe did not compile, else "enforced"."""
    outcomes = set()
    for schema, instance in PROBES[feature]:
        try:
            compiled = backend.compile("json_schema", json.dumps(schema))
        except GrammarError:
            outcomes.add("refused")
            continue
        ids = tokenizer.encode(compact_json(instance), add_special_tokens=False)
        accepted = matcher_accepts(compiled.create_matcher(), ids, tokenizer.eos_token_id)
        outcomes.add("ignored" if accepted else "enforced")
    for verdict in ("ignored", "refused"):
        if verdict in outcomes:
            return verdict
    return "enforced"


def test_probes_break_only_their_feature() -> None:
    for feature, probes in PROBES.items():
        for schema, instance in probes:
            cls = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
            assert not cls(schema).is_valid(instance), (feature, instance)
            assert feature in {f for f, _, _ in features(schema)}, (feature, schema)


def test_every_feature_the_walk_names_has_a_probe() -> None:
    named = set().union(*(limits.enforced | limits.refused for limits in BACKEND_LIMITS.values()))
    assert named <= set(PROBES)


@pytest.mark.parametrize("name", sorted(BACKEND_LIMITS))
def test_table_matches_measurement(
    name: str, backends: dict[str, BaseGrammarBackend], tokenizer: Any
) -> None:
    limits = BACKEND_LIMITS[name]
    assert importlib.metadata.version(PACKAGES[name]) == limits.version, (
        f"{name} upgraded: measure it again and update BACKEND_LIMITS"
    )
    # outlines-core needs minutes for the untyped probes (a regex for any JSON value), and a
    # feature wrongly called ignored or refused costs coverage only: its enforced claims, which
    # soundness rests on, are measured; the rest was measured once (the table's comment).
    probed = sorted(limits.enforced) if name == "outlines" else list(PROBES)
    measured = {f: _measure(backends[name], tokenizer, f) for f in probed}
    wrong = {}
    for feature, verdict in measured.items():
        expected = ("enforced" if feature in limits.enforced
                    else "refused" if feature in limits.refused else "ignored")
        # Claimed refused but enforced is still sound; any other difference is not.
        if expected != verdict and not (expected == "refused" and verdict == "enforced"):
            wrong[feature] = f"table says {expected}, measured {verdict}"
    assert not wrong, f"{name}: {wrong}"


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
    assert ignored_keywords("xgrammar", schema) == [
        "uniqueItems at /properties/tags",
        "not at /properties/a~1b",
        "if at /$defs/x/anyOf/0",
    ]
    assert ignored_keywords("llguidance", schema) == []  # it refuses them instead
    assert ignored_keywords("unmeasured", {"type": "string"}) == ["type at /"]


def test_length_next_to_pattern_is_its_own_feature() -> None:
    schema = {"type": "string", "pattern": "^a+$", "maxLength": 2}
    assert ignored_keywords("xgrammar", schema) == ["maxLength at /"]
    assert ignored_keywords("xgrammar", {"type": "string", "maxLength": 2}) == []


def test_chain_puts_sound_backends_first() -> None:
    names = ["llguidance", "xgrammar", "outlines"]
    plan = plan_chain("json_schema", json.dumps({"type": "string", "pattern": "^a+$",
                                                 "maxLength": 2}), names)
    assert plan.sound and plan.steps[0].backend == "llguidance"
    # xgrammar ignores maxLength next to pattern; outlines (measured) enforces it.
    assert [(s.backend, s.ignored) for s in plan.steps] == [
        ("llguidance", ()), ("outlines", ()), ("xgrammar", ("maxLength at /",))]
    # llguidance refuses uniqueItems (it is still tried: it refuses by itself), xgrammar ignores
    # it: strict keeps llguidance alone, and no backend is known to enforce it.
    unique = json.dumps({"type": "array", "uniqueItems": True})
    strict = plan_chain("json_schema", unique, names, strict=True)
    assert [s.backend for s in strict.steps] == ["llguidance"] and not strict.sound
    assert strict.ignored_by_all["llguidance"] == ("uniqueItems at / (refused)",)
    assert strict.ignored_by_all["xgrammar"] == ("uniqueItems at /",)
    loose = plan_chain("json_schema", unique, names)
    assert [s.backend for s in loose.steps][:2] == ["llguidance", "xgrammar"]
    assert loose.best_partial() == ("uniqueItems at /",)
    # Other kinds: the configured order.
    assert [s.backend for s in plan_chain("regex", "a+", names).steps] == names


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
        assert not constraint.strict
    ok = {"type": "string", "pattern": "^a+$", "maxLength": 2}  # llguidance enforces both
    constraint = constraint_from_request(_chat(ok, strict=True))
    assert constraint is not None and constraint.strict


def test_strict_service_never_compiles_on_an_unsound_backend(chain_service: Any) -> None:
    from splitserve.engine.grammar.options import CompileOptions

    unique = json.dumps({"type": "array", "uniqueItems": True})
    with pytest.raises(GrammarError, match="llguidance: .*uniqueItems"):
        chain_service.compile("json_schema", unique, CompileOptions(strict=True))
    loose = chain_service.compile("json_schema", unique)
    assert loose.backend_name == "xgrammar" and loose.ignored == ("uniqueItems at /",)
    sound = chain_service.compile("json_schema", json.dumps({"maxLength": 2, "pattern": "^a+$"}),
                                  CompileOptions(strict=True))
    assert sound.backend_name == "llguidance" and sound.ignored == ()
