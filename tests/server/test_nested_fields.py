"""The sub-field tables of the request's nested objects (``server.nested_fields``) against
OpenAI's spec, the check they drive (a refused sub-field is a 400 naming its dotted path), the
sub-fields honoured (``stream_options.continuous_usage_stats``, ``messages[].name``), and the
``openai`` client with the fields it sends, all on the fake engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from splitserve.server.chat_template import ChatRenderer
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.fields import FIELDS, PATHS
from splitserve.server.nested_fields import NESTED_FIELDS, markdown_table, path_steps
from splitserve.server.routes import create_app
from splitserve.server.sse import DONE, iter_events
from tests.doc_section import generated_section

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "tests" / "data" / "openai-openapi" / "openapi.json"
SCHEMAS = {"chat": "CreateChatCompletionRequest", "completions": "CreateCompletionRequest"}
MODEL = "smol-test"

# ---- the spec, walked by path -----------------------------------------------------------------


def _components() -> dict[str, Any]:
    return json.loads(SPEC.read_text())["components"]["schemas"]


COMPONENTS = _components()


def alternatives(schema: dict) -> list[dict]:
    """``schema`` and every schema its ``oneOf``/``anyOf``/``allOf`` reach, ``$ref`` resolved."""
    while "$ref" in schema:
        schema = COMPONENTS[schema["$ref"].rsplit("/", 1)[1]]
    out = [schema]
    for key in ("oneOf", "anyOf", "allOf"):
        for alt in schema.get(key, []):
            out.extend(alternatives(alt))
    return out


def properties(schemas: list[dict]) -> dict[str, list[dict]]:
    """Each property name of any of ``schemas`` (and their variants), with every schema given
    for it: the ``messages[]`` variants each define ``content`` their own way."""
    props: dict[str, list[dict]] = {}
    for schema in schemas:
        for alt in alternatives(schema):
            for name, prop in alt.get("properties", {}).items():
                props.setdefault(name, []).append(prop)
    return props


def items(schemas: list[dict]) -> list[dict]:
    """The item schemas of the arrays among ``schemas`` (and their variants)."""
    return [alt["items"] for s in schemas for alt in alternatives(s) if "items" in alt]


def spec_at(endpoint: str, path: str) -> list[dict]:
    """The spec's schemas of the object at ``path`` (``nested_fields`` syntax). A root the
    endpoint's schema lacks (completions' ``response_format``, our extension there) is read
    from chat's."""
    top = properties([COMPONENTS[SCHEMAS[endpoint]]])
    steps = path_steps(path)
    schemas = top.get(steps[0][0]) or properties([COMPONENTS[SCHEMAS["chat"]]])[steps[0][0]]
    for i, (key, is_list) in enumerate(steps):
        if i:
            schemas = properties(schemas)[key]
        if is_list:
            schemas = items(schemas)
    return schemas


def nested_paths(endpoint: str) -> list[str]:
    return list(NESTED_FIELDS[endpoint])


@pytest.mark.parametrize(("endpoint", "path"), [(e, p) for e in ("chat", "completions")
                                                for p in nested_paths(e)])
def test_every_spec_sub_field_is_classified(endpoint: str, path: str) -> None:
    spec = properties(spec_at(endpoint, path))
    table = NESTED_FIELDS[endpoint][path]
    assert spec, f"{path}: the spec has no properties there (a wrong path?)"
    missing = sorted(set(spec) - set(table))
    assert not missing, f"sub-fields of OpenAI's {path} not in server.nested_fields: {missing}"
    for name, rule in table.items():
        assert rule.spec == (name in spec), f"{path}.{name}: spec flag is wrong"
        assert rule.status == "implemented" or rule.note, f"{path}.{name}: say why"


def _has_object_props(schemas: list[dict]) -> bool:
    return bool(properties(schemas))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_nested_object_has_a_table(endpoint: str) -> None:
    """From each implemented field down through implemented sub-fields: every object whose
    spec lists properties has a table (free-form objects, like ``parameters``, list none)."""
    tables = NESTED_FIELDS[endpoint]
    chat_top = properties([COMPONENTS[SCHEMAS["chat"]]])
    top = {**chat_top, **properties([COMPONENTS[SCHEMAS[endpoint]]])}
    todo = [(name, top[name]) for name, rule in FIELDS[endpoint].items()
            if rule.status == "implemented" and name in top]
    seen = []
    while todo:
        path, schemas = todo.pop()
        for candidate, below in ((path, schemas), (f"{path}[]", items(schemas))):
            if not _has_object_props(below):
                continue
            assert candidate in tables, f"{endpoint}: {candidate} has sub-fields but no table"
            seen.append(candidate)
            props = properties(below)
            for name, rule in tables[candidate].items():
                if rule.status == "implemented" and name in props:
                    todo.append((f"{candidate}.{name}", props[name]))
    assert sorted(seen) == sorted(tables), "a table for an object no implemented field reaches"


def test_api_doc_sub_field_table_is_the_generated_one() -> None:
    table = generated_section("nested-fields")
    assert table == markdown_table(), (
        "docs/api.md's sub-field table differs from server.nested_fields: paste `python -m "
        "splitserve.server.nested_fields` between its nested-fields markers")


# ---- the check, through the app ---------------------------------------------------------------


@pytest.fixture(scope="module")
def fake(tokenizer) -> FakeEngineClient:
    return FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def client(fake, tokenizer) -> TestClient:
    return TestClient(create_app(fake, tokenizer, MODEL, 512, [tokenizer.eos_token_id]))


BASE = {"chat": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        "completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4}}
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _history(call: dict) -> dict:
    return {"messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]}


# Per table: a body fragment with ``extra`` merged into one object of that table (a valid
# request as it stands), and that object's dotted path.
PLACES: dict[str, tuple[Any, str]] = {
    "stream_options": (lambda x: {"stream": True, "stream_options": {"include_usage": True, **x}},
                       "stream_options"),
    "response_format": (lambda x: {"response_format": {"type": "text", **x}}, "response_format"),
    "response_format.json_schema": (lambda x: {"response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}, **x}}},
        "response_format.json_schema"),
    "tools[]": (lambda x: {"tools": [{"type": "function", "function": {"name": "noop"}},
                                     {"type": "function", "function": WEATHER, **x}]},
                "tools[1]"),
    "tools[].function": (lambda x: {"tools": [{"type": "function", "function": {**WEATHER, **x}}]},
                         "tools[0].function"),
    "tool_choice": (lambda x: {"tools": [{"type": "function", "function": WEATHER}],
                               "tool_choice": {"type": "function",
                                               "function": {"name": "get_weather"}, **x}},
                    "tool_choice"),
    "tool_choice.function": (lambda x: {"tools": [{"type": "function", "function": WEATHER}],
                                        "tool_choice": {"type": "function", "function": {
                                            "name": "get_weather", **x}}},
                             "tool_choice.function"),
    "messages[]": (lambda x: {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": "Hello.", **x}]},
                   "messages[2]"),
    "messages[].content[]": (lambda x: {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": " there", **x}]}]},
        "messages[0].content[1]"),
    "messages[].tool_calls[]": (lambda x: _history({**CALL, **x}), "messages[1].tool_calls[0]"),
    "messages[].tool_calls[].function": (
        lambda x: _history({**CALL, "function": {**CALL["function"], **x}}),
        "messages[1].tool_calls[0].function"),
}
# A value of each refused sub-field that asks for something (others get "x").
ASKING: dict[str, Any] = {
    "custom": {"name": "c"}, "allowed_tools": {"mode": "auto", "tools": []},
    "audio": {"id": "audio_1"}, "function_call": {"name": "f", "arguments": "{}"},
    "refusal": "I cannot help with that.", "image_url": {"url": "https://example.com/a.png"},
    "input_audio": {"data": "AAAA", "format": "wav"}, "file": {"file_id": "file-1"},
}
# A value of each ignored sub-field, as a client would send it.
IGNORED_VALUES: dict[str, Any] = {
    "include_obfuscation": True, "name": "answer", "prompt_cache_breakpoint": {"mode": "explicit"},
}


def _body(endpoint: str, path: str, extra: dict) -> tuple[dict, str]:
    make, where = PLACES[path]
    return {**BASE[endpoint], **make(extra)}, where


def _rules(status: str) -> list[tuple[str, str, str]]:
    return [(e, p, n) for e in ("chat", "completions") for p, table in NESTED_FIELDS[e].items()
            for n, r in table.items() if r.status == status]


def test_every_table_has_a_place() -> None:
    assert set(PLACES) == set(NESTED_FIELDS["chat"]) >= set(NESTED_FIELDS["completions"])


@pytest.mark.parametrize(("endpoint", "path"), [(e, p) for e in ("chat", "completions")
                                                for p in nested_paths(e)])
def test_each_place_alone_is_served(client, endpoint: str, path: str) -> None:
    body, _ = _body(endpoint, path, {})
    r = client.post(PATHS[endpoint], json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("endpoint", "path", "name"), _rules("refused"))
def test_refused_sub_field_is_a_400_naming_its_path(client, fake, endpoint, path, name) -> None:
    body, where = _body(endpoint, path, {name: ASKING.get(name, "x")})
    before = len(fake.requests)
    r = client.post(PATHS[endpoint], json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == f"{where}.{name}", err
    assert err["code"] == "unsupported_parameter" and err["type"] == "invalid_request_error"
    assert err["message"].startswith(f"{where}.{name}: not supported")
    assert len(fake.requests) == before  # nothing reached the engine


@pytest.mark.parametrize(("endpoint", "path", "name", "value"), [
    (e, p, n, v) for e, p, n in _rules("refused")
    for v in (None, *NESTED_FIELDS[e][p][n].noop)])
def test_refused_sub_field_at_null_or_its_noop_is_accepted(client, endpoint, path, name,
                                                           value) -> None:
    body, _ = _body(endpoint, path, {name: value})
    r = client.post(PATHS[endpoint], json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("endpoint", "path", "name"), _rules("ignored"))
def test_ignored_sub_field_is_accepted(client, endpoint, path, name) -> None:
    body, _ = _body(endpoint, path, {name: IGNORED_VALUES[name]})
    r = client.post(PATHS[endpoint], json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["tools[].function", "messages[]", "messages[].content[]",
                                  "stream_options", "response_format.json_schema"])
def test_sub_fields_outside_the_spec_are_ignored(client, path) -> None:
    # Clients send their own extras, as at the top level (vendor fields, our own responses'
    # extras echoed back).
    body, _ = _body("chat", path, {"xyz": {"vendor": 1}})
    assert client.post(PATHS["chat"], json=body).status_code == 200


def test_the_first_refused_sub_field_is_named(client) -> None:
    body = {**BASE["chat"], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello.", "audio": {"id": "a"}, "refusal": "no"}]}
    r = client.post(PATHS["chat"], json=body)
    assert r.json()["error"]["param"] == "messages[1].audio"


# ---- stream_options.continuous_usage_stats ----------------------------------------------------


def _chunks(client: TestClient, endpoint: str, **fields: Any) -> list[dict]:
    body = {**BASE[endpoint], "max_tokens": 12, "stream": True, **fields}
    with client.stream("POST", PATHS[endpoint], json=body) as r:
        assert r.status_code == 200, r.read()
        events = list(iter_events(r.iter_lines()))
    assert events[-1] == DONE
    return events[:-1]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_puts_usage_on_every_chunk(client, endpoint) -> None:
    full = client.post(PATHS[endpoint], json={**BASE[endpoint], "max_tokens": 12}).json()
    chunks = _chunks(client, endpoint, stream_options={"continuous_usage_stats": True})
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"] == full["usage"]  # include_usage turned on
    usages = [c["usage"] for c in choice_chunks]
    assert all(u is not None for u in usages), usages
    assert {u["prompt_tokens"] for u in usages} == {full["usage"]["prompt_tokens"]}
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == full["usage"]["completion_tokens"] == 12
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    if endpoint == "chat":
        assert counts[0] == 0  # the role chunk, before any token (as vLLM sends it)
    # Without it, the same stream carries usage only on its last chunk.
    plain = _chunks(client, endpoint, stream_options={"include_usage": True})
    assert [c["usage"] for c in plain[:-1]] == [None] * (len(plain) - 1)
    assert plain[-1]["usage"] == full["usage"]


def test_continuous_usage_counts_each_choice(client) -> None:
    chunks = _chunks(client, "chat", n=2, stream_options={"include_usage": True,
                                                          "continuous_usage_stats": True})
    last_count = {c["choices"][0]["index"]: c["usage"]["completion_tokens"]
                  for c in chunks if c["choices"]}
    assert last_count == {0: 12, 1: 12}
    assert chunks[-1]["usage"]["completion_tokens"] == 24  # the usage chunk sums the choices


def test_continuous_usage_with_tools_streams_usage_on_call_chunks(tokenizer) -> None:
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply=reply)
    app = create_app(fake, tokenizer, MODEL, 512, [tokenizer.eos_token_id])
    chunks = _chunks(TestClient(app), "chat", max_tokens=64,
                     tools=[{"type": "function", "function": WEATHER}],
                     stream_options={"continuous_usage_stats": True})
    calls = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    assert calls and all(c["usage"]["completion_tokens"] > 0 for c in calls)


def test_continuous_usage_without_include_usage_is_a_400(client) -> None:
    body = {**BASE["chat"], "stream": True,
            "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    r = client.post(PATHS["chat"], json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stream_options.continuous_usage_stats", err
    assert "include_usage" in err["message"]


# ---- messages[].name --------------------------------------------------------------------------

NAMED = ("{% for m in messages %}<{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}>"
         "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
# The same, writing the tools it is given: its messages skip the built-in tool prompt's rewrite.
NAMED_WITH_TOOLS = "{% for t in tools or [] %}{{ t.function.name }}\n{% endfor %}" + NAMED


@pytest.mark.parametrize("template", [NAMED, NAMED_WITH_TOOLS])
@pytest.mark.parametrize("with_tools", [False, True])
def test_message_names_reach_the_template(tokenizer, template, with_tools) -> None:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)
    renderer = ChatRenderer(tokenizer, template=template)
    assert renderer.renders_tools == (template == NAMED_WITH_TOOLS)
    client = TestClient(create_app(fake, tokenizer, MODEL, 512, [tokenizer.eos_token_id],
                                   renderer))
    messages = [{"role": "system", "content": "Be brief.", "name": "policy"},
                {"role": "user", "content": "hi", "name": "ada"},
                {"role": "user", "content": "and me", "name": "grace"}]
    tools = {"tools": [{"type": "function", "function": WEATHER}]} if with_tools else {}
    r = client.post(PATHS["chat"], json={**BASE["chat"], "messages": messages, **tools})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(fake.requests[-1][1])
    for text in ("<system name=policy>Be brief.", "<user name=ada>hi", "<user name=grace>and me"):
        assert text in prompt, prompt
    unnamed = [{k: v for k, v in m.items() if k != "name"} for m in messages]
    client.post(PATHS["chat"], json={**BASE["chat"], "messages": unnamed, **tools})
    assert "name=" not in tokenizer.decode(fake.requests[-1][1])


def _json_schema_format(description: str | None) -> dict:
    spec = {"name": "person", "schema": {"type": "object", "properties": {"n": {"type": "string"}},
                                         "required": ["n"]}}
    if description is not None:
        spec["description"] = description
    return {"type": "json_schema", "json_schema": spec}


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_json_schema_description_is_shown_to_the_model(tokenizer, system) -> None:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)
    client = TestClient(create_app(fake, tokenizer, MODEL, 512, [tokenizer.eos_token_id],
                                   ChatRenderer(tokenizer, template=NAMED)))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "Ada"}]
    hint = "The person the user names, with their name in n."
    r = client.post(PATHS["chat"], json={**BASE["chat"], "messages": messages,
                                         "response_format": _json_schema_format(hint)})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(fake.requests[-1][1])
    want = f'<system>{system + chr(10) * 2 if system else ""}Respond in the JSON format "person": {hint}'
    assert want in prompt, prompt
    assert prompt.count("<system>") == 1
    client.post(PATHS["chat"], json={**BASE["chat"], "messages": messages,
                                     "response_format": _json_schema_format(None)})
    assert "Respond in the JSON format" not in tokenizer.decode(fake.requests[-1][1])


@pytest.mark.parametrize("fmt_type", ["text", "json_object"])
def test_json_schema_description_is_shown_only_with_its_format(tokenizer, fmt_type) -> None:
    # Under "text" or "json_object" a json_schema is no part of OpenAI's format and its schema
    # is not enforced; its description is not shown either (it was, with no schema held).
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)
    client = TestClient(create_app(fake, tokenizer, MODEL, 512, [tokenizer.eos_token_id],
                                   ChatRenderer(tokenizer, template=NAMED)))
    fmt = {**_json_schema_format("Answer like a pirate."), "type": fmt_type}
    r = client.post(PATHS["chat"], json={**BASE["chat"], "response_format": fmt})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(fake.requests[-1][1])
    assert "pirate" not in prompt and "<system>" not in prompt, prompt


def test_json_schema_description_on_completions_is_a_400(client) -> None:
    r = client.post(PATHS["completions"], json={**BASE["completions"],
                                                "response_format": _json_schema_format("a hint")})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format.json_schema.description"


# ---- the openai client ------------------------------------------------------------------------


@pytest.fixture
def api(tokenizer):
    """The ``openai`` client over the app in-process (TestClient is an ``httpx.Client``)."""
    import openai

    reply = '{"city": "Paris"}'  # valid for the structured-output call below
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply=reply)
    app = create_app(fake, tokenizer, MODEL, 512, [tokenizer.eos_token_id])
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                         http_client=TestClient(app))


def test_openai_client_round_trips_its_own_fields(api) -> None:
    import openai
    import pydantic

    class City(pydantic.BaseModel):
        city: str

    user = {"role": "user", "content": "Where?", "name": "ada"}
    first = api.chat.completions.create(model=MODEL, messages=[user], max_tokens=20)
    # The assistant message object goes back as the client serializes it.
    again = api.chat.completions.create(
        model=MODEL, max_tokens=20, tools=[openai.pydantic_function_tool(City)],
        messages=[user, first.choices[0].message, {"role": "user", "content": "And?"}])
    assert again.choices[0].message.content == '{"city": "Paris"}'
    # An OpenAI reply's message as clients store it: the fields OpenAI sends, null.
    stored = {"role": "assistant", "content": "Paris.", "refusal": None, "audio": None,
              "function_call": None, "annotations": []}
    api.chat.completions.create(model=MODEL, messages=[user, stored, user], max_tokens=4)
    parsed = api.chat.completions.parse(model=MODEL, messages=[user], response_format=City,
                                        max_tokens=20)
    assert parsed.choices[0].message.parsed == City(city="Paris")
    stream = api.chat.completions.create(
        model=MODEL, messages=[user], max_tokens=20, stream=True,
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            user, {"role": "assistant", "content": None, "refusal": "I cannot."}, user])
    assert info.value.body["param"] == "messages[1].refusal"
    assert info.value.body["code"] == "unsupported_parameter"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_stream_is_a_400(client, endpoint, stream) -> None:
    # OpenAI's spec: "only set this when you set stream: true" (vLLM refuses it too).
    body = {**BASE[endpoint], "stream_options": {"include_usage": True}}
    if stream is not None:
        body["stream"] = stream
    r = client.post(PATHS[endpoint], json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stream_options", err
    assert "stream" in err["message"], err
    # An empty or null stream_options, or null sub-fields, ask for nothing: accepted.
    for empty in ({}, None, {"include_usage": None, "continuous_usage_stats": None}):
        r = client.post(PATHS[endpoint], json={**BASE[endpoint], "stream_options": empty})
        assert r.status_code == 200, r.text
