"""The field table (``server.fields``) against OpenAI's spec, and the check it drives: every
property of the spec's request schemas is in the table with the spec's range, every refused field
is a 400 naming it, and docs/api.md's table is the generated one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.fields import CHAT_FIELDS, COMPLETION_FIELDS, FIELDS, PATHS, markdown_table
from splitserve.server.routes import create_app
from tests.doc_section import generated_section

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "tests" / "data" / "openai-openapi" / "openapi.json"
SCHEMAS = {"chat": "CreateChatCompletionRequest", "completions": "CreateCompletionRequest"}
MODEL = "smol-test"


def spec_properties(endpoint: str) -> dict[str, dict]:
    """The request schema's properties, its ``allOf`` parts merged, each with its ``$ref`` and
    one level of ``anyOf``/``oneOf`` resolved to where its bounds are written."""
    components = json.loads(SPEC.read_text())["components"]["schemas"]

    def deref(schema: dict) -> dict:
        while "$ref" in schema:
            schema = components[schema["$ref"].rsplit("/", 1)[1]]
        return schema

    props: dict[str, dict] = {}
    stack = [components[SCHEMAS[endpoint]]]
    while stack:
        schema = deref(stack.pop())
        stack.extend(schema.get("allOf", []))
        props.update(schema.get("properties", {}))
    return {name: deref(p) for name, p in props.items()}


def spec_bounds(prop: dict) -> tuple[float | None, float | None]:
    for alt in [prop, *prop.get("anyOf", []), *prop.get("oneOf", [])]:
        if "minimum" in alt or "maximum" in alt:
            return alt.get("minimum"), alt.get("maximum")
    return None, None


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_spec_property_is_in_the_table(endpoint: str) -> None:
    spec = spec_properties(endpoint)
    assert len(spec) > 10  # the spec was read, not an empty schema
    missing = sorted(set(spec) - set(FIELDS[endpoint]))
    assert not missing, f"fields of OpenAI's {SCHEMAS[endpoint]} not in server.fields: {missing}"
    for name, rule in FIELDS[endpoint].items():
        assert rule.spec == (name in spec), f"{endpoint}.{name}: spec flag is wrong"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_implemented_fields_keep_the_spec_range(endpoint: str) -> None:
    """Each bound the spec documents is in the table (ours may only be narrower)."""
    for name, prop in spec_properties(endpoint).items():
        rule = FIELDS[endpoint][name]
        lo, hi = spec_bounds(prop)
        if rule.status != "implemented":
            continue
        if lo is not None:  # the spec writes 2^63 as a rounded float: compare as floats
            assert rule.minimum is not None and float(rule.minimum) >= float(lo), name
        if hi is not None:
            assert rule.maximum is not None and float(rule.maximum) <= float(hi), name
        if lo is None and hi is None:
            continue
        narrower = (lo is not None and not math.isclose(float(rule.minimum), float(lo))) or (
            hi is not None and not math.isclose(float(rule.maximum), float(hi)))
        assert not narrower or rule.note, f"{endpoint}.{name}: narrower than the spec, say why"


def test_api_doc_table_is_the_generated_one() -> None:
    table = generated_section("fields")
    assert table == markdown_table(), (
        "docs/api.md's field table differs from server.fields: paste `python -m "
        "splitserve.server.fields` between its fields markers")


# ---- the check, through the app ---------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tokenizer) -> TestClient:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)
    return TestClient(create_app(fake, tokenizer, MODEL, 256, [tokenizer.eos_token_id]))


BASE = {"chat": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2}}
# A value of each refused field that asks for something (its no-op values are tested apart).
ASKING = {"store": True, "metadata": {"k": "v"}, "service_tier": "flex", "modalities": ["audio"],
          "audio": {"voice": "alloy", "format": "mp3"}, "prediction": {"type": "content",
          "content": "x"}, "web_search_options": {}, "verbosity": "low", "reasoning_effort": "low",
          "moderation": {"model": "m"}, "functions": [{"name": "f"}], "function_call": "auto",
          "suffix": " end", "best_of": 2}


def refused(endpoint: str) -> list[str]:
    return sorted(n for n, r in FIELDS[endpoint].items() if r.status == "refused")


@pytest.mark.parametrize("endpoint,name", [(e, n) for e in ("chat", "completions")
                                           for n in refused(e)])
def test_refused_field_is_a_400_naming_it(client, endpoint: str, name: str) -> None:
    r = client.post(PATHS[endpoint], json={**BASE[endpoint], name: ASKING[name]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["type"] == "invalid_request_error"
    assert err["code"] == "unsupported_parameter" and name in err["message"]


@pytest.mark.parametrize("endpoint,name,value", [
    (e, n, v) for e in ("chat", "completions") for n in refused(e)
    for v in (None, *FIELDS[e][n].noop)])
def test_refused_field_at_its_noop_value_is_accepted(client, endpoint, name, value) -> None:
    r = client.post(PATHS[endpoint], json={**BASE[endpoint], name: value})
    assert r.status_code == 200, r.text


def test_noop_values_compare_types(client) -> None:
    # 0 == False and 1.0 == 1 in Python; store: 0 is not store: false.
    r = client.post(PATHS["chat"], json={**BASE["chat"], "store": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"


@pytest.mark.parametrize("endpoint,name,value", [
    ("chat", "presence_penalty", 5), ("chat", "frequency_penalty", -2.5),
    ("chat", "temperature", 3), ("chat", "top_logprobs", 21), ("chat", "n", 0),
    ("chat", "n", 129), ("completions", "n", 17), ("chat", "seed", 2**64), ("chat", "seed", -(2**63) - 1),
    ("completions", "seed", 2**63), ("completions", "logprobs", 6),
    ("completions", "presence_penalty", 2.01), ("completions", "top_p", 1.5),
    ("completions", "max_tokens", -1), ("chat", "top_k", 2**40), ("chat", "temperature", "NaN"),
])
def test_out_of_range_is_a_400_naming_the_field(client, endpoint, name, value) -> None:
    body = json.dumps(BASE[endpoint])[:-1] + f', "{name}": {value}' + "}"  # NaN as a JSON token
    r = client.post(PATHS[endpoint], content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("endpoint,name,value", [
    ("chat", "seed", 2**63 - 1), ("chat", "seed", -(2**63)), ("completions", "seed", 0),
    ("chat", "temperature", 2), ("completions", "top_p", 1), ("chat", "user", "u-1"),
    ("chat", "prompt_cache_key", "k"), ("chat", "safety_identifier", "s"),
    ("chat", "some_vendor_extension", {"x": 1}),  # not in the spec: ignored
])
def test_in_range_and_ignored_fields_are_accepted(client, endpoint, name, value) -> None:
    r = client.post(PATHS[endpoint], json={**BASE[endpoint], name: value})
    assert r.status_code == 200, r.text


def test_tables_name_each_status() -> None:
    for table in (CHAT_FIELDS, COMPLETION_FIELDS):
        for name, rule in table.items():
            assert rule.status in ("implemented", "refused", "ignored"), name
            assert rule.status == "implemented" or rule.note, f"{name}: say why"
