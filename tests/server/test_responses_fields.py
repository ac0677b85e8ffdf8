"""The Responses field tables (``server.responses_api.fields``) against OpenAI's spec
(``CreateResponse`` and every kind of its typed objects), docs/api.md's generated table, and the
check they drive, through the app on the fake engine: a refused field, sub-field, kind or
``include`` value is a 400 naming it in OpenAI's error shape and reaches no engine; its no-op
values are accepted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.nested_fields import path_steps
from splitserve.server.responses_api.fields import (
    INCLUDE_VALUES,
    RESPONSES_FIELDS,
    RESPONSES_NESTED,
    RESPONSES_TYPED,
    markdown_table,
)
from splitserve.server.routes import create_app
from tests.doc_section import generated_section

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "tests" / "data" / "openai-openapi" / "openapi.json"
COMPONENTS = json.loads(SPEC.read_text())["components"]["schemas"]
MODEL = "smol-test"
PATH = "/v1/responses"


def deref(schema: dict) -> dict:
    while "$ref" in schema:
        schema = COMPONENTS[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def alternatives(schema: dict) -> list[dict]:
    schema = deref(schema)
    out = [schema]
    for key in ("oneOf", "anyOf", "allOf"):
        for alt in schema.get(key, []):
            out.extend(alternatives(alt))
    return out


def properties(schemas: list[dict]) -> dict[str, list[dict]]:
    props: dict[str, list[dict]] = {}
    for schema in schemas:
        for alt in alternatives(schema):
            for name, prop in alt.get("properties", {}).items():
                props.setdefault(name, []).append(prop)
    return props


def items(schemas: list[dict]) -> list[dict]:
    return [alt["items"] for s in schemas for alt in alternatives(s) if "items" in alt]


def spec_at(path: str) -> list[dict]:
    """The spec's schemas of the objects at ``path`` (``nested_fields`` syntax)."""
    schemas = [COMPONENTS["CreateResponse"]]
    for key, is_list in path_steps(path):
        schemas = properties(schemas)[key]
        if is_list:
            schemas = items(schemas)
    return schemas


def kind_of(schema: dict) -> list[str]:
    prop = deref(schema.get("properties", {}).get("type", {}))
    return [v for alt in alternatives(prop) for v in alt.get("enum", [])]


def variants(path: str) -> dict[str, list[dict]]:
    """Each kind the spec has at ``path``, with the variants of that kind."""
    out: dict[str, list[dict]] = {}
    for schema in spec_at(path):
        for alt in alternatives(schema):
            for name in kind_of(alt):
                out.setdefault(name, []).append(alt)
    return out


def test_every_spec_field_is_in_the_table() -> None:
    spec = properties([COMPONENTS["CreateResponse"]])
    assert len(spec) > 20
    assert sorted(set(spec) - set(RESPONSES_FIELDS)) == []
    assert sorted(set(RESPONSES_FIELDS) - set(spec)) == []
    for name, rule in RESPONSES_FIELDS.items():
        assert rule.status == "implemented" or rule.note, name


def test_implemented_fields_keep_the_spec_range() -> None:
    for name, props in properties([COMPONENTS["CreateResponse"]]).items():
        rule = RESPONSES_FIELDS[name]
        bounds = [(a.get("minimum"), a.get("maximum")) for p in props for a in alternatives(p)
                  if "minimum" in a or "maximum" in a]
        if rule.status != "implemented" or not bounds:
            continue
        lo, hi = bounds[0]
        if lo is not None:
            assert rule.minimum is not None and rule.minimum >= lo, name
        if hi is not None:
            assert rule.maximum is not None and rule.maximum <= hi, name


@pytest.mark.parametrize("path", list(RESPONSES_NESTED))
def test_every_nested_sub_field_is_classified(path: str) -> None:
    spec = properties(spec_at(path))
    assert spec, path
    assert sorted(set(spec) ^ set(RESPONSES_NESTED[path])) == []


@pytest.mark.parametrize("path", list(RESPONSES_TYPED))
def test_every_kind_and_its_sub_fields_are_classified(path: str) -> None:
    """Each kind the spec allows at ``path`` is in the table; an implemented kind lists every
    property of its spec variants (the union of them), and nothing else."""
    table = RESPONSES_TYPED[path]
    spec = variants(path)
    if path == "tools[].tools[]":  # the tools of the namespace kind only
        spec = {}
        namespace_tools = items(properties(variants("tools[]")["namespace"])["tools"])
        for alt in (a for s in namespace_tools for a in alternatives(s)):
            for name in kind_of(alt):
                spec.setdefault(name, []).append(alt)
    assert spec, path
    assert sorted(set(spec) ^ set(table.kinds)) == [], path
    for name, rule in table.kinds.items():
        assert rule.note, f"{path} {name}: say what it does or why not"
        if rule.status != "implemented":
            assert not rule.fields
            continue
        spec_fields = set(properties(spec[name]))
        assert sorted(spec_fields ^ set(rule.fields)) == [], f"{path} {name}"
        for sub, sub_rule in rule.fields.items():
            assert sub_rule.status == "implemented" or sub_rule.note, f"{path} {name}.{sub}"


def test_every_include_value_is_classified() -> None:
    prop = properties([COMPONENTS["CreateResponse"]])["include"]
    values = {v for s in items(prop) for alt in alternatives(s) for v in alt.get("enum", [])}
    assert values and values == set(INCLUDE_VALUES)


def test_api_doc_table_is_the_generated_one() -> None:
    assert generated_section("responses-fields") == markdown_table(), (
        "docs/api.md's Responses table differs from server.responses_api.fields: paste "
        "`python -m splitserve.server.responses_api.fields` between its markers")


# ---- the check, through the app ---------------------------------------------------------------


@pytest.fixture(scope="module")
def fake(tokenizer) -> FakeEngineClient:
    return FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def client(fake, tokenizer) -> TestClient:
    return TestClient(create_app(fake, tokenizer, MODEL, 512, [tokenizer.eos_token_id]))


BASE = {"model": MODEL, "input": "hi", "max_output_tokens": 16, "store": False}
# A value of each refused field that asks for something.
ASKING: dict[str, Any] = {
    "truncation": "auto", "service_tier": "flex", "prompt": {"id": "pmpt_1"},
    "conversation": "conv_1", "context_management": [{"type": "compaction"}],
    "moderation": {"model": "omni-moderation-latest"},
}
FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}
# Per nested or typed path: a body with ``extra`` merged into one object there, and its path.
PLACES: dict[str, Any] = {
    "stream_options": lambda x: ({"stream": True, "stream_options": x}, "stream_options"),
    "text": lambda x: ({"text": x}, "text"),
    "reasoning": lambda x: ({"reasoning": x}, "reasoning"),
}
NESTED_ASKING = {"verbosity": "low", "effort": "high", "summary": "detailed",
                 "generate_summary": "concise", "context": "all_turns", "mode": "pro"}


def refused_fields() -> list[str]:
    return sorted(n for n, r in RESPONSES_FIELDS.items() if r.status == "refused")


@pytest.mark.parametrize("name", refused_fields())
def test_refused_field_is_a_400_naming_it(client, fake, name: str) -> None:
    before = len(fake.requests)
    r = client.post(PATH, json={**BASE, name: ASKING[name]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["code"] == "unsupported_parameter", err
    assert err["type"] == "invalid_request_error" and name in err["message"]
    assert len(fake.requests) == before


@pytest.mark.parametrize(("name", "value"), [(n, v) for n in refused_fields()
                                             for v in (None, *RESPONSES_FIELDS[n].noop)])
def test_refused_field_at_null_or_its_noop_is_accepted(client, name: str, value: Any) -> None:
    assert client.post(PATH, json={**BASE, name: value}).status_code == 200


@pytest.mark.parametrize(("path", "name"), [(p, n) for p, t in RESPONSES_NESTED.items()
                                            for n, r in t.items() if r.status == "refused"])
def test_refused_sub_field_is_a_400_naming_its_path(client, path: str, name: str) -> None:
    body, where = PLACES[path]({name: NESTED_ASKING[name]})
    r = client.post(PATH, json={**BASE, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"{where}.{name}"
    for value in (None, *RESPONSES_NESTED[path][name].noop):
        body, _ = PLACES[path]({name: value})
        assert client.post(PATH, json={**BASE, **body}).status_code == 200, (name, value)


def _with_kind(path: str, kind: str) -> tuple[dict[str, Any], str]:
    """A body whose object at ``path`` is of ``kind`` (with only its ``type``), and where."""
    obj = {"type": kind}
    return {
        "input[]": ({"input": [{"role": "user", "content": "hi"}, obj]}, "input[1]"),
        "input[].content[]": ({"input": [{"role": "user", "content": [obj]}]},
                              "input[0].content[0]"),
        "input[].output[]": ({"input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [obj]}]},
            "input[1].output[0]"),
        "tools[]": ({"tools": [FUNCTION, obj]}, "tools[1]"),
        "tools[].tools[]": ({"tools": [{"type": "namespace", "name": "ns", "tools": [obj]}]},
                            "tools[0].tools[0]"),
        "tool_choice": ({"tools": [FUNCTION], "tool_choice": obj}, "tool_choice"),
        "text.format": ({"text": {"format": obj}}, "text.format"),
    }[path]


@pytest.mark.parametrize(("path", "kind"), [(p, k) for p, t in RESPONSES_TYPED.items()
                                            for k, r in t.kinds.items() if r.status == "refused"])
def test_refused_kind_is_a_400_naming_it(client, fake, path: str, kind: str) -> None:
    body, where = _with_kind(path, kind)
    before = len(fake.requests)
    r = client.post(PATH, json={**BASE, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == f"{where}.type" and err["code"] == "unsupported_parameter", err
    assert repr(kind) in err["message"]
    assert len(fake.requests) == before


@pytest.mark.parametrize("name", ["web_search", "file_search", "code_interpreter",
                                  "computer_use_preview", "mcp", "image_generation"])
def test_built_in_tools_are_400s_naming_them(client, name: str) -> None:
    r = client.post(PATH, json={**BASE, "tools": [{"type": name}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].type", r.text
    assert name in r.json()["error"]["message"]


# One sub-field a client may send per kind that refuses it, with a value that asks.
SUB_ASKING = [
    ("input[]", {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                 "caller": {"type": "program", "caller_id": "p"}}, "input[1].caller"),
    ("tools[]", {**FUNCTION, "defer_loading": True}, "tools[1].defer_loading"),
    ("tools[]", {**FUNCTION, "allowed_callers": ["program"]}, "tools[1].allowed_callers"),
]


@pytest.mark.parametrize(("path", "obj", "param"), SUB_ASKING)
def test_refused_sub_field_of_a_kind_is_a_400(client, path, obj, param) -> None:
    body = ({"input": [{"role": "user", "content": "hi"}, obj]} if path == "input[]"
            else {"tools": [FUNCTION, obj]})
    r = client.post(PATH, json={**BASE, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("value", sorted(v for v, r in INCLUDE_VALUES.items()
                                         if r.status == "refused"))
def test_refused_include_value_is_a_400(client, value: str) -> None:
    r = client.post(PATH, json={**BASE, "include": ["message.output_text.logprobs", value]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include[1]", r.text


@pytest.mark.parametrize(("name", "value"), [
    ("temperature", 2.5), ("top_p", 1.5), ("top_logprobs", 21), ("max_output_tokens", 15),
])
def test_out_of_range_is_a_400_naming_the_field(client, name: str, value: Any) -> None:
    r = client.post(PATH, json={**BASE, name: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


@pytest.mark.parametrize(("name", "value"), [
    ("user", "u-1"), ("safety_identifier", "s"), ("prompt_cache_key", "k"),
    ("prompt_cache_retention", "24h"), ("max_tool_calls", 3), ("client_metadata", {"a": "b"}),
    ("include", ["reasoning.encrypted_content"]), ("stream_options", None),
])
def test_ignored_and_extra_fields_are_accepted(client, name: str, value: Any) -> None:
    assert client.post(PATH, json={**BASE, name: value}).status_code == 200
