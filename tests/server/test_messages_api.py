"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` on the fake engine (it "generates" a
fixed reply): the answer's blocks, ``stop_reason`` and ``usage``; the event stream in order and
reassembled to the full answer; tool calls as ``tool_use`` blocks; what each request field
becomes in the job the engine gets (prompt, constraint, sampling); and every error in
Anthropic's shape, on these paths only."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import DEFAULT_REPLY, FakeEngineClient
from splitserve.server.guard import install_guard
from splitserve.server.metrics import ServerMetrics, install_metrics
from splitserve.server.rate_limit import RateLimiter
from splitserve.server.routes import create_app
from splitserve.server.tenancy import Tenancy
from tests.messages_api import anthropic_events, check_anthropic_error, reassembled

MODEL = "smol-test"
M = "/v1/messages"
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
CALL_REPLY = ('Looking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              "</tool_call>")


def _app(tokenizer, reply: str = DEFAULT_REPLY, context_len: int = 2048,
         tenancy: Tenancy | None = None) -> tuple[TestClient, FakeEngineClient]:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply=reply)
    app = create_app(fake, tokenizer, MODEL, context_len, [tokenizer.eos_token_id],
                     tenancy=tenancy)
    return TestClient(app), fake


def _post(client: TestClient, path: str = M, **body) -> dict:
    body = {"model": MODEL, "max_tokens": 64, "messages": USER, **body}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(client: TestClient, **body) -> list[dict]:
    body = {"model": MODEL, "max_tokens": 64, "messages": USER, "stream": True, **body}
    r = client.post(M, json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return anthropic_events(r.text)


def test_text_answer_usage_and_count_tokens(tokenizer) -> None:
    client, fake = _app(tokenizer)
    body = _post(client, system="Be brief.")
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["id"].startswith("msg_") and body["model"] == MODEL
    assert body["content"] == [{"type": "text", "text": DEFAULT_REPLY}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    _, ids, sampling = fake.requests[-1]
    assert body["usage"] == {"input_tokens": len(ids), "output_tokens": len(fake.output_ids(
        sampling)), "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    assert "Be brief." in tokenizer.decode(ids)
    r = client.post("/v1/messages/count_tokens",
                    json={"model": MODEL, "messages": USER, "system": "Be brief."})
    assert r.json() == {"input_tokens": len(ids)}
    again = _post(client, system="Be brief.")  # the fake's prefix cache: all of it read
    assert again["usage"]["cache_read_input_tokens"] == len(ids)
    assert again["usage"]["input_tokens"] == 0


def test_stream_events_come_in_order_and_reassemble_to_the_full_answer(tokenizer) -> None:
    client, _ = _app(tokenizer)
    full = _post(client, max_tokens=9)
    events = _stream(client, max_tokens=9)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"} and len(kinds) > 7
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0
    message = reassembled(events)
    assert message["stop_reason"] == "max_tokens" == full["stop_reason"]
    assert message["content"] == full["content"]
    assert message["usage"]["output_tokens"] == full["usage"]["output_tokens"] == 9


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_is_a_tool_use_block(tokenizer, stream: bool) -> None:
    client, _ = _app(tokenizer, reply=CALL_REPLY)
    body = (reassembled(_stream(client, tools=[WEATHER])) if stream else
            _post(client, tools=[WEATHER]))
    text, call = body["content"]
    assert text == {"type": "text", "text": "Looking."}
    assert call["type"] == "tool_use" and call["name"] == "get_weather"
    assert call["input"] == {"city": "Paris"} and call["id"].startswith("toolu_")
    assert body["stop_reason"] == "tool_use"
    if stream:  # no call markup in any text delta
        events = _stream(client, tools=[WEATHER])
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        assert not any("tool_call" in d.get("text", "") for d in deltas)
        args = "".join(d["partial_json"] for d in deltas if d["type"] == "input_json_delta")
        assert args == '{"city": "Paris"}'  # the model's own text, as it wrote it


def _structural_tag(fake: FakeEngineClient) -> dict | None:
    constraint = fake.requests[-1][2].constraint
    if constraint is None:
        return None
    assert constraint.kind == "structural_tag"
    return json.loads(constraint.text)


def test_tool_choice_maps_onto_the_call_grammar(tokenizer) -> None:
    client, fake = _app(tokenizer, reply=CALL_REPLY)
    other = {**WEATHER, "name": "get_time"}
    _post(client, tools=[WEATHER, other], tool_choice={"type": "auto"})
    auto = json.dumps(_structural_tag(fake))
    assert "triggered_tags" in auto and "get_time" in auto
    _post(client, tools=[WEATHER, other], tool_choice={"type": "any"})
    required = json.dumps(_structural_tag(fake))
    assert '"at_least_one": true' in required and '"stop_after_first": false' in required
    _post(client, tools=[WEATHER, other], tool_choice={"type": "any",
                                                       "disable_parallel_tool_use": True})
    assert '"stop_after_first": true' in json.dumps(_structural_tag(fake))
    _post(client, tools=[WEATHER, other], tool_choice={"type": "tool", "name": "get_time"})
    named = json.dumps(_structural_tag(fake))
    assert "get_time" in named and "get_weather" not in named
    body = _post(client, tools=[WEATHER, other], tool_choice={"type": "none"})
    assert _structural_tag(fake) is None
    assert "get_weather" not in tokenizer.decode(fake.requests[-1][1])  # as chat's "none"
    assert body["stop_reason"] == "end_turn" and len(body["content"]) == 1  # text only


def test_tool_loop_history_is_rendered_and_checked(tokenizer) -> None:
    client, fake = _app(tokenizer)
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    history = [*USER,
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "SECRET PLAN",
                                                  "signature": "sig"},
                                                 {"type": "text", "text": "Checking."}, call]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain",
                    "is_error": True},
                   {"type": "text", "text": "And tomorrow?"}]}]
    _post(client, tools=[WEATHER], messages=history)
    prompt = tokenizer.decode(fake.requests[-1][1])
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nError: rain\n</tool_response>" in prompt
    assert prompt.index("</tool_response>") < prompt.index("And tomorrow?")
    assert "SECRET PLAN" not in prompt  # earlier turns' thinking is not shown, as Anthropic does
    wrong = [*history[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]
    r = client.post(M, json={"model": MODEL, "max_tokens": 8, "messages": wrong})
    err = check_anthropic_error(r.status_code, r.text)
    assert r.status_code == 400 and err["message"].startswith(
        "messages[2].content[0].tool_use_id: 'toolu_9'")


def test_prefill_and_merged_turns(tokenizer) -> None:
    client, fake = _app(tokenizer)
    body = _post(client, messages=[{"role": "user", "content": "Name a colour."},
                                   {"role": "user", "content": [{"type": "text", "text": " Now."}]},
                                   {"role": "assistant", "content": "The colour is"}])
    prompt = tokenizer.decode(fake.requests[-1][1])
    assert prompt.endswith("<|im_start|>user\nName a colour. Now.<|im_end|>\n"
                           "<|im_start|>assistant\nThe colour is")
    assert body["content"][0]["text"] == DEFAULT_REPLY  # the continuation only


def test_stop_sequences_name_the_one_matched(tokenizer) -> None:
    client, _ = _app(tokenizer)
    stops = ["zz1", "zz2", "zz3", "zz4", "fake", "engine"]  # more than chat's four
    for body in (_post(client, stop_sequences=stops),
                 reassembled(_stream(client, stop_sequences=stops))):
        assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "fake"
        assert body["content"] == [{"type": "text", "text": "Hello from the "}]


def test_max_tokens_past_the_context_window_stops_there(tokenizer) -> None:
    client, fake = _app(tokenizer, reply="one two three four five six " * 20, context_len=64)
    body = _post(client, max_tokens=100000)
    room = 64 - len(fake.requests[-1][1])
    assert fake.requests[-1][2].max_new_tokens == room
    assert body["stop_reason"] == "model_context_window_exceeded"
    assert body["usage"]["output_tokens"] == room
    assert _post(client, max_tokens=3)["stop_reason"] == "max_tokens"


def test_max_tokens_zero_only_computes_the_prompt(tokenizer) -> None:
    client, fake = _app(tokenizer)
    for body in (_post(client, max_tokens=0), reassembled(_stream(client, max_tokens=0))):
        assert body["content"] == [] and body["stop_reason"] == "max_tokens"
        assert body["usage"]["output_tokens"] == 0
        assert fake.requests[-1][2].max_new_tokens == 1


def test_sampling_and_output_format_reach_the_job(tokenizer) -> None:
    client, fake = _app(tokenizer, reply='{"city": "Paris"}')
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    _post(client, temperature=0.5, top_p=0.9, top_k=7,
          output_config={"format": {"type": "json_schema", "schema": schema}})
    sampling = fake.requests[-1][2]
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.9, 7)
    assert sampling.constraint.kind == "json_schema" and sampling.constraint.strict
    assert json.loads(sampling.constraint.text) == schema
    bad = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3,
                                                  "not": {"const": 6}}}}
    r = client.post(M, json={"model": MODEL, "max_tokens": 8, "messages": USER,
                             "output_config": {"format": {"type": "json_schema", "schema": bad}}})
    assert r.status_code == 400
    assert check_anthropic_error(400, r.text)["message"].startswith("output_config.format: ")


BAD_BODIES = [
    ({"messages": USER}, "max_tokens: Field required"),
    ({"max_tokens": 8, "messages": USER, "foo": 1}, "foo: unknown field"),
    ({"max_tokens": 8, "messages": USER, "container": "c1"}, "container: not supported"),
    ({"max_tokens": 8, "messages": USER, "temperature": 1.5}, "temperature: 1.5 is above"),
    ({"max_tokens": 8, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 2048}},
     "thinking: the served model has no reasoning parser"),
    ({"max_tokens": 8, "messages": USER, "context_management": {"edits": [
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 9}}]}},
     "context_management.edits[0].type: "),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]},
     "messages[0].content[0].source: not supported"),
    ({"max_tokens": 8, "messages": USER, "tools": [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]},
     "tools[0].type: 'web_search_20250305' is a server tool"),
    ({"max_tokens": 8, "messages": USER, "tools": [WEATHER], "tool_choice": {"type": "tool"}},
     "tool_choice: name is required"),
    ({"max_tokens": 8, "messages": USER, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice: the function 'nope'"),
    ({"max_tokens": 8, "messages": USER, "tools": [{**WEATHER, "strict": True, "input_schema": {
        "type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}}]},
     "tools[0].input_schema: the function is strict"),
    ({"max_tokens": -1, "messages": USER}, "max_tokens: -1 is below the minimum 0"),
    ({"max_tokens": 8, "messages": []}, "messages: List should have at least 1 item"),
]


@pytest.mark.parametrize(("body", "message"), BAD_BODIES)
def test_bad_requests_are_400_in_anthropics_shape(tokenizer, body: dict, message: str) -> None:
    client, fake = _app(tokenizer)
    r = client.post(M, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert check_anthropic_error(400, r.text)["message"].startswith(message)
    assert not fake.requests


def test_other_errors_are_in_anthropics_shape_on_messages_paths_only(tokenizer) -> None:
    client, _ = _app(tokenizer)
    r = client.post(M, json={"model": "claude-x", "max_tokens": 8, "messages": USER})
    assert r.status_code == 404 and "claude-x" in check_anthropic_error(404, r.text)["message"]
    r = client.post(M, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in check_anthropic_error(400, r.text)[
        "message"]
    r = client.post(M, content=b"{}", headers={"content-type": "text/plain"})  # browser guard
    assert r.status_code == 415 and "must be JSON" in check_anthropic_error(415, r.text)[
        "message"]
    r = client.get(M)
    check_anthropic_error(r.status_code, r.text)
    assert r.status_code == 405
    r = client.post(M + "/batches", json={})
    assert r.status_code == 404 and check_anthropic_error(404, r.text)
    r = client.post("/v1/chat/completions", json={"model": "claude-x", "messages": USER})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"  # OpenAI's shape
    assert r.json()["error"]["code"] == "model_not_found"


def test_worker_errors_before_and_after_the_first_event(tokenizer) -> None:
    client, fake = _app(tokenizer)
    fake.error = ("no healthy worker", 503)
    r = client.post(M, json={"model": MODEL, "max_tokens": 8, "messages": USER, "stream": True})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert check_anthropic_error(503, r.text)["message"] == "no healthy worker"
    fake.error_after_events = 1
    events = _stream(client)
    assert events[-1] == {"type": "error", "error": {"type": "overloaded_error",
                                                     "message": "no healthy worker"}}
    assert "message_stop" not in [e["type"] for e in events]


def test_x_api_key_and_the_guards_errors(tokenizer) -> None:
    fake = FakeEngineClient(tokenizer, tokenizer.eos_token_id)
    app = create_app(fake, tokenizer, MODEL, 2048, [tokenizer.eos_token_id])
    install_metrics(app, ServerMetrics())
    install_guard(app, "sk-1", max_body_bytes=2000)
    client = TestClient(app)
    body = {"model": MODEL, "max_tokens": 4, "messages": USER}
    r = client.post(M, json=body)
    assert r.status_code == 401 and "x-api-key" in check_anthropic_error(401, r.text)["message"]
    assert client.post(M, json=body, headers={"x-api-key": "wrong"}).status_code == 401
    assert client.post(M, json=body, headers={"x-api-key": "sk-1"}).status_code == 200
    assert client.post(M, json=body, headers={"Authorization": "Bearer sk-1"}).status_code == 200
    chat = {"model": MODEL, "messages": USER, "max_tokens": 4}
    r = client.post("/v1/chat/completions", json=chat, headers={"x-api-key": "sk-1"})
    assert r.status_code == 200  # one key, either header, every route
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    big = {**body, "system": "x" * 3000}
    r = client.post(M, json=big, headers={"x-api-key": "sk-1"})
    assert r.status_code == 413 and check_anthropic_error(413, r.text)


def test_rate_limit_is_429_in_anthropics_shape(tokenizer) -> None:
    now = [0.0]
    limiter = RateLimiter(requests_per_s=1, clock=lambda: now[0])
    client, fake = _app(tokenizer, tenancy=Tenancy(limiter))
    _post(client)
    r = client.post(M, json={"model": MODEL, "max_tokens": 4, "messages": USER})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    check_anthropic_error(429, r.text)
    assert len(fake.requests) == 1


def test_claude_codes_thinking_and_context_management_are_served(tokenizer) -> None:
    """Claude Code sends these on every request: adaptive thinking (a model without a reasoning
    parser answers without thinking) and a clear_thinking edit (no earlier thinking is shown)."""
    client, fake = _app(tokenizer)
    fields = {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
              "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                "keep": "all"}]}}
    body = _post(client, **fields)
    assert [b["type"] for b in body["content"]] == ["text"] and len(fake.requests) == 1
    r = client.post(M + "/count_tokens", json={"model": MODEL, "messages": USER, **{
        k: v for k, v in fields.items() if k != "output_config"}})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text


def test_claude_code_billing_header_block_is_not_prompt(tokenizer) -> None:
    """Claude Code's first system block is ``x-anthropic-billing-header: ...`` with a suffix
    that changes with the conversation's first message: it never reaches the prompt, so two
    conversations with the same system prompt and tools share that prefix in the cache."""
    client, fake = _app(tokenizer)

    def system(suffix: str) -> list[dict]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix};"
                 " cc_entrypoint=sdk-cli;"},
                {"type": "text", "text": "You are a coding agent.",
                 "cache_control": {"type": "ephemeral"}}]

    first = _post(client, system=system("6c5"))
    _, ids, _ = fake.requests[-1]
    prompt = tokenizer.decode(ids)
    assert "You are a coding agent." in prompt and "billing" not in prompt
    second = _post(client, system=system("3bb"),
                   messages=[{"role": "user", "content": "Weather in Rome?"}])
    _, ids2, _ = fake.requests[-1]
    shared = next(i for i, (a, b) in enumerate(zip(ids, ids2)) if a != b)
    assert "You are a coding agent." in tokenizer.decode(ids[:shared])  # system prompt shared
    assert first["usage"]["cache_read_input_tokens"] == 0
    assert second["usage"]["cache_read_input_tokens"] == shared
    plain = _post(client, system="You are a coding agent.")
    assert fake.requests[-1][1] == ids  # as if the header block were not there
    assert plain["usage"]["cache_read_input_tokens"] == len(ids)
    # The same line first in a string system prompt; a prompt that held only it is none.
    _post(client, system="x-anthropic-billing-header: cc_version=1;\nYou are a coding agent.")
    assert fake.requests[-1][1] == ids
    r = client.post("/v1/messages/count_tokens",
                    json={"model": MODEL, "messages": USER, "system": system("abc")})
    assert r.json() == {"input_tokens": len(ids)}
    _post(client, system=[system("6c5")[0]])
    bare = fake.requests[-1][1]
    _post(client)
    assert fake.requests[-1][1] == bare
