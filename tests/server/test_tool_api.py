"""Tool calling through the HTTP API against the fake engine (it "generates" a fixed reply): the
built-in tool prompt in the prompt and in ``usage.prompt_tokens``, the call grammar sent with the
request, the reply parsed into ``tool_calls`` (full and streamed), tool history accepted, and the
tool fields' 400s."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from splitserve.server.chat_template import ChatRenderer
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.routes import create_app
from splitserve.server.sse import iter_events
from splitserve.server.tools.formats import HERMES, MISTRAL

MODEL = "smol-test"
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL_REPLY = ('Looking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              "</tool_call>")
HISTORY = [
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


def _app(tokenizer, reply: str = CALL_REPLY, **chat) -> tuple[TestClient, FakeEngineClient]:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply=reply)
    renderer = ChatRenderer(tokenizer, **chat)
    app = create_app(fake, tokenizer, MODEL, 2048, [tokenizer.eos_token_id], renderer)
    return TestClient(app), fake


def _post(client: TestClient, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_builtin_prompt_lists_the_tools_and_counts_them(tokenizer) -> None:
    client, fake = _app(tokenizer)
    assert not ChatRenderer(tokenizer).renders_tools  # SmolLM2's template ignores tools
    plain = _post(client, tool_choice="none", tools=[WEATHER])
    _, plain_ids, plain_sampling = fake.requests[-1]
    with_tools = _post(client, tools=[WEATHER])
    _, ids, sampling = fake.requests[-1]
    prompt = tokenizer.decode(ids)
    for text in ("get_weather", "Current weather in a city", '"required": ["city"]',
                 "<tool_call>"):
        assert text in prompt
    assert "get_weather" not in tokenizer.decode(plain_ids)  # "none": tools left out
    assert with_tools["usage"]["prompt_tokens"] == len(ids) > plain["usage"]["prompt_tokens"]
    assert plain_sampling.constraint is None
    assert sampling.constraint is not None and sampling.constraint.kind == "structural_tag"


def test_reply_parsed_into_tool_calls(tokenizer) -> None:
    client, _ = _app(tokenizer)
    body = _post(client, tools=[WEATHER])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Looking."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_only_calls_gives_null_content(tokenizer) -> None:
    client, _ = _app(tokenizer, reply=CALL_REPLY.removeprefix("Looking.\n"))
    message = _post(client, tools=[WEATHER], tool_choice="required")["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1


def test_without_tools_the_markup_is_plain_content(tokenizer) -> None:
    client, fake = _app(tokenizer)
    choice = _post(client)["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": CALL_REPLY}
    assert choice["finish_reason"] == "stop" and fake.requests[-1][2].constraint is None


def test_streamed_call_deltas(tokenizer) -> None:
    client, _ = _app(tokenizer)
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": USER, "tools": [WEATHER], "stream": True})
    assert r.status_code == 200
    events = [e for e in iter_events(r.text.splitlines()) if isinstance(e, dict)]
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Looking."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_tool_history_is_accepted_and_rendered(tokenizer) -> None:
    client, fake = _app(tokenizer, reply="It is 21 C.")
    body = _post(client, messages=HISTORY, tools=[WEATHER])
    assert body["choices"][0]["message"]["content"] == "It is 21 C."
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt = tokenizer.decode(fake.requests[-1][1])
    # The built-in prompt writes the earlier call as the model would and the result as a
    # <tool_response> block.
    assert HERMES.render_calls([("get_weather", '{"city": "Paris"}')]) in prompt
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in prompt


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
     "tool_choice"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools[0].type"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "strict": True,
        "parameters": {"type": "object", "properties": {"x": {"type": "array",
                                                               "uniqueItems": True}}}}}]},
     "tools[0].function.parameters"),
    ({"parallel_tool_calls": "yes", "tools": [WEATHER]}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]"),
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_fields_are_400_naming_the_field(tokenizer, body: dict, param: str) -> None:
    client, fake = _app(tokenizer)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"] or "").startswith(param), error
    assert not fake.requests


def test_named_choice_and_parallel_off_reach_the_grammar(tokenizer) -> None:
    client, fake = _app(tokenizer)
    add = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    _post(client, tools=[WEATHER, add], tool_choice={"type": "function",
                                                     "function": {"name": "add"}})
    begins = [t["begin"] for t in json.loads(fake.requests[-1][2].constraint.text)["format"]["tags"]]
    assert begins and all('"name": "add"' in b for b in begins)
    _post(client, tools=[WEATHER, add], parallel_tool_calls=False)
    assert json.loads(fake.requests[-1][2].constraint.text)["format"]["stop_after_first"]


def test_forced_parser_and_template_file(tokenizer, tmp_path) -> None:
    # A template that renders tools and names no known format: the forced parser is used.
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}assistant:")
    mistral_reply = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    client, fake = _app(tokenizer, reply=mistral_reply, template=template,
                        tool_call_parser="mistral")
    choice = _post(client, tools=[WEATHER])["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    prompt = tokenizer.decode(fake.requests[-1][1])
    assert prompt.startswith("user: Weather in Paris?\nTOOLS [{") and "get_weather" in prompt
    assert ChatRenderer(tokenizer, template, "mistral").tool_format is MISTRAL


# Renders tools and names no format (no tool-call marker in its text).
PLAIN_TOOLS_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                        "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}assistant:")


def test_auto_parser_takes_the_model_family_format(tokenizer) -> None:
    """``auto`` with a template that names no format: the family's declared format is parsed
    (before: the built-in Hermes one), end to end through the API."""
    assert ChatRenderer(tokenizer, PLAIN_TOOLS_TEMPLATE).tool_format is HERMES  # no family
    mistral_reply = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    client, _ = _app(tokenizer, reply=mistral_reply, template=PLAIN_TOOLS_TEMPLATE,
                     family_format="mistral")
    call = _post(client, tools=[WEATHER])["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["arguments"] == '{"city": "Rome"}'
    assert len(call["id"]) == 9  # Mistral's call ids (Hermes': call_...)
    assert ChatRenderer(tokenizer, PLAIN_TOOLS_TEMPLATE, family_format="mistral").tool_format is (
        MISTRAL)


def test_auto_parser_order(tokenizer) -> None:
    """The template's own format comes before the family's; a template that ignores tools
    keeps the built-in prompt's format; a named parser overrides both; a bad family name is
    an error."""
    hermes_template = PLAIN_TOOLS_TEMPLATE.replace("TOOLS", "<tool_call>")
    assert ChatRenderer(tokenizer, hermes_template, family_format="llama3_json").tool_format is HERMES
    assert ChatRenderer(tokenizer, family_format="mistral").tool_format is HERMES  # SmolLM2's
    renderer = ChatRenderer(tokenizer, PLAIN_TOOLS_TEMPLATE, "hermes", family_format="mistral")
    assert renderer.tool_format is HERMES
    with pytest.raises(ValueError, match="tool-call parser"):
        ChatRenderer(tokenizer, family_format="nope")


def test_server_reads_the_family_format_from_config(model_path, tmp_path) -> None:
    """The API server learns the family's format from ``config.json``'s architecture (no
    weights loaded); a family with none gives None."""
    from splitserve.server.main import read_model_facts

    assert read_model_facts(str(model_path))[2] == "llama3_json"  # SmolLM2: LlamaForCausalLM
    config = json.loads((model_path / "config.json").read_text())
    for arch, expected in (("Qwen2ForCausalLM", "hermes"), ("Phi3ForCausalLM", None)):
        (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
        assert read_model_facts(str(tmp_path))[2] == expected, arch


CUT_REPLY = CALL_REPLY + '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'


@pytest.mark.parametrize("cut_at", ['\n<', '\n<tool_call>\n{"na', '\n<tool_call>\n{"name": "get'])
def test_a_call_cut_by_max_tokens_leaks_no_markup_on_any_endpoint(tokenizer, cut_at) -> None:
    """``max_tokens`` ends the answer inside the start of a second call (its marker, or before
    its name is complete): the first call is whole, and no markup reaches the text of chat
    (whole and streamed), Messages or Responses."""
    reply = CALL_REPLY + cut_at
    client, _ = _app(tokenizer, reply=reply + " and more")
    limit = len(tokenizer.encode(reply, add_special_tokens=False))
    assert tokenizer.decode(tokenizer.encode(reply, add_special_tokens=False)) == reply
    whole = _post(client, tools=[WEATHER], max_tokens=limit)["choices"][0]
    assert whole["finish_reason"] == "length" and "<" not in (whole["message"]["content"] or "")
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "stream": True,
                                                  "tools": [WEATHER], "max_tokens": limit})
    chunks = [e for e in iter_events(r.text.splitlines()) if e != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "<" not in text
    anthropic_tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": limit, "messages": USER,
                                          "tools": [anthropic_tool]})
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks] == ["text", "tool_use"], blocks
    assert r.json()["stop_reason"] == "max_tokens" and "<" not in blocks[0]["text"]
    r = client.post("/v1/responses", json={"model": MODEL, "input": "Weather in Paris?",
                                           "max_output_tokens": max(limit, 16), "store": False,
                                           "tools": [{"type": "function", **WEATHER["function"]}]})
    items = r.json()["output"]
    texts = [p["text"] for i in items if i["type"] == "message" for p in i["content"]]
    assert "function_call" in [i["type"] for i in items] and not any("<" in t for t in texts)
