"""``POST /v1/responses`` and its stored-response routes on the fake engine (``tests/server``):
the translation into the chat path's job (the prompt the chat route would build), output items
and their streamed events (order, ``sequence_number`` s, reassembly), tool calls and a tool loop
through ``previous_response_id``, logprobs, errors in OpenAI's shapes, background responses
(polling, cancel), tenants, and the ``openai`` client's own calls."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import DEFAULT_REPLY, FakeEngineClient
from splitserve.server.guard import install_guard
from splitserve.server.routes import create_app
from splitserve.server.tenancy import ApiKey, KeyRing
from tests.http_api import WAIT_S

MODEL = "smol-test"
PATH = "/v1/responses"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}, "strict": True}


def make(tokenizer, reply: str = DEFAULT_REPLY, **fake_kw: Any) -> tuple[TestClient, Any]:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply=reply,
                            **fake_kw)
    return TestClient(create_app(fake, tokenizer, MODEL, 2048, [tokenizer.eos_token_id])), fake


def stream_events(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed response's events; each SSE event names its type as OpenAI's do."""
    with client.stream("POST", PATH, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        events.append(payload)
    return events


def output_text(body: dict[str, Any]) -> str:
    return "".join(part["text"] for item in body["output"] if item["type"] == "message"
                   for part in item["content"])


@pytest.fixture
def app(tokenizer) -> tuple[TestClient, Any]:
    return make(tokenizer)


def test_plain_response_is_the_chat_answer_and_is_stored(app, tokenizer) -> None:
    client, fake = app
    r = client.post(PATH, json={"model": MODEL, "input": "Say hi", "instructions": "Be brief.",
                                "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "completed" and body["id"].startswith("resp_")
    assert output_text(body) == DEFAULT_REPLY
    assert body["metadata"] == {"k": "v"} and body["instructions"] == "Be brief."
    usage = body["usage"]
    assert usage["output_tokens"] == len(fake.output_ids(fake.requests[-1][2]))
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # The prompt is exactly the chat route's for the same conversation.
    prompt = fake.requests[-1][1]
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]})
    assert chat.status_code == 200 and fake.requests[-1][1] == prompt
    assert chat.json()["choices"][0]["message"]["content"] == output_text(body)
    assert client.get(f"{PATH}/{body['id']}").json() == body


def test_streamed_events_are_in_order_and_reassemble_the_response(app) -> None:
    client, _ = app
    events = stream_events(client, {"model": MODEL, "input": "Say hi", "max_output_tokens": 16})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert events[0]["response"]["status"] == "in_progress"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == output_text(final) == events[-4]["text"]
    assert events[-2]["item"] == final["output"][0]
    assert final["output"][0]["status"] == "incomplete"
    assert client.get(f"{PATH}/{final['id']}").json() == final


def test_tool_call_is_a_function_call_item_streamed_without_markup(tokenizer) -> None:
    client, _ = make(tokenizer, reply="Checking. " + CALL)
    body = {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER]}
    full = client.post(PATH, json=body).json()
    message, call = full["output"]
    assert message["type"] == "message" and message["status"] == "completed"
    assert output_text(full) == "Checking."
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    events = stream_events(client, body)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Checking." and "<tool_call>" not in text
    args = "".join(e["delta"] for e in events
                   if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert args == done["arguments"] and done["name"] == "get_weather"
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1]
    assert events[-1]["type"] == "response.completed"


def test_tool_loop_across_three_turns_with_previous_response_id(tokenizer) -> None:
    client, fake = make(tokenizer, reply=CALL)
    first = client.post(PATH, json={"model": MODEL, "input": "Weather in Paris?",
                                    "tools": [WEATHER], "tool_choice": "required"}).json()
    (call,) = first["output"]
    fake.reply_ids = tokenizer.encode("It is 21 C in Paris.", add_special_tokens=False)
    second = client.post(PATH, json={
        "model": MODEL, "previous_response_id": first["id"], "tools": [WEATHER],
        "input": [{"type": "function_call_output", "call_id": call["call_id"],
                   "output": '{"celsius": 21}'}]}).json()
    assert output_text(second) == "It is 21 C in Paris."
    prompt = tokenizer.decode(fake.requests[-1][1])
    assert "Weather in Paris?" in prompt and '"city": "Paris"' in prompt
    assert '{"celsius": 21}' in prompt  # the tool output, as the template renders results
    third = client.post(PATH, json={"model": MODEL, "previous_response_id": second["id"],
                                    "input": "Thanks! And tomorrow?"}).json()
    assert third["status"] == "completed"
    prompt = tokenizer.decode(fake.requests[-1][1])
    for text in ("Weather in Paris?", '"city": "Paris"', '{"celsius": 21}',
                 "It is 21 C in Paris.", "Thanks! And tomorrow?"):
        assert text in prompt, text
    listed = client.get(f"{PATH}/{third['id']}/input_items", params={"order": "asc"}).json()
    kinds = [(i["type"], i.get("role")) for i in listed["data"]]
    assert kinds == [("message", "user"), ("function_call", None), ("function_call_output", None),
                     ("message", "assistant"), ("message", "user")]
    assert listed["data"][1] == call and not listed["has_more"]
    page = client.get(f"{PATH}/{third['id']}/input_items",
                      params={"limit": 2, "after": listed["data"][-1]["id"]}).json()
    assert [i["id"] for i in page["data"]] == [i["id"] for i in listed["data"][-2:-4:-1]]
    assert page["has_more"]


def test_item_reference_resolves_a_stored_item(tokenizer) -> None:
    client, fake = make(tokenizer, reply=CALL)
    first = client.post(PATH, json={"model": MODEL, "input": "Weather?", "tools": [WEATHER]})
    call = first.json()["output"][0]
    r = client.post(PATH, json={"model": MODEL, "tools": [WEATHER], "input": [
        {"role": "user", "content": "Weather?"}, {"type": "item_reference", "id": call["id"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]})
    assert r.status_code == 200, r.text
    assert '"city": "Paris"' in tokenizer.decode(fake.requests[-1][1])
    r = client.post(PATH, json={"model": MODEL, "input": [
        {"type": "item_reference", "id": "fc_unknown"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].id"


def test_reasoning_items_are_dropped_from_the_prompt(app, tokenizer) -> None:
    client, fake = app
    r = client.post(PATH, json={"model": MODEL, "input": [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "SECRET THOUGHT"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello.",
                                           "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Again"}]}]})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(fake.requests[-1][1])
    assert "SECRET THOUGHT" not in prompt and "Hello." in prompt and "Again" in prompt


def test_namespace_functions_are_called_by_name_and_namespace(tokenizer) -> None:
    reply = ('<tool_call>\n{"name": "weather__get_weather", "arguments": {"city": "Paris"}}\n'
             "</tool_call>")
    client, fake = make(tokenizer, reply=reply)
    namespace = {"type": "namespace", "name": "weather", "description": "Weather tools.",
                 "tools": [WEATHER]}
    body = client.post(PATH, json={"model": MODEL, "input": "Weather?",
                                   "tools": [namespace]}).json()
    (call,) = body["output"]
    assert (call["name"], call["namespace"]) == ("get_weather", "weather")
    prompt = tokenizer.decode(fake.requests[-1][1])
    assert "weather__get_weather" in prompt and "Weather tools. Weather in a city" in prompt
    # Sent back, the call is rendered under the name the model used.
    fake.reply_ids = tokenizer.encode("Sunny.", add_special_tokens=False)
    r = client.post(PATH, json={"model": MODEL, "previous_response_id": body["id"],
                                "tools": [namespace], "input": [
                                    {"type": "function_call_output", "call_id": call["call_id"],
                                     "output": "sunny"}]})
    assert r.status_code == 200, r.text


def test_logprobs_with_include(app) -> None:
    client, _ = app
    body = {"model": MODEL, "input": "Hi", "include": ["message.output_text.logprobs"],
            "top_logprobs": 2}
    full = client.post(PATH, json=body).json()
    part = full["output"][0]["content"][0]
    # One entry per generated token (the end-of-text one too, as on chat), spelled by bytes.
    assert len(part["logprobs"]) == full["usage"]["output_tokens"]
    assert b"".join(bytes(lp["bytes"]) for lp in part["logprobs"]).decode().startswith(part["text"])
    events = stream_events(client, body)
    streamed = [lp for e in events if e["type"] == "response.output_text.delta"
                for lp in e["logprobs"]]
    assert streamed == part["logprobs"]
    plain = client.post(PATH, json={"model": MODEL, "input": "Hi"}).json()
    assert plain["output"][0]["content"][0]["logprobs"] == []


def test_text_format_json_schema_is_the_chat_constraint(tokenizer) -> None:
    client, fake = make(tokenizer, reply='{"city": "Paris"}')
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = client.post(PATH, json={"model": MODEL, "input": "Where?", "text": {"format": {
        "type": "json_schema", "name": "place", "schema": schema, "strict": True}}})
    assert r.status_code == 200, r.text
    constraint = fake.requests[-1][2].constraint
    assert constraint.kind == "json_schema" and json.loads(constraint.text) == schema
    assert r.json()["text"]["format"]["name"] == "place"


@pytest.mark.parametrize(("body", "param"), [
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[0].arguments"),
    ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {
        "x": {"type": "array", "uniqueItems": True}}}}]}, "tools[0].parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"background": True, "store": False}, "background"),
    ({"background": True, "stream": True}, "stream"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text"),
])
def test_bad_requests_are_400s_naming_the_responses_field(app, body, param) -> None:
    client, fake = app
    before = len(fake.requests)
    r = client.post(PATH, json={"model": MODEL, "input": "hi", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"].startswith(param) or param in err["message"]
    assert len(fake.requests) == before


def test_a_model_not_served_is_a_404_naming_it(app) -> None:
    """As on ``/v1/chat/completions``: the model, or a LoRA adapter on it, resolves in
    ``JobBuilder`` (``server.models``); any other name is OpenAI's ``model_not_found``."""
    client, fake = app
    before = len(fake.requests)
    r = client.post(PATH, json={"model": "other", "input": "hi"})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found" and "'other'" in \
        err["message"]
    assert len(fake.requests) == before


def test_an_error_before_the_first_token_is_plain_json(tokenizer) -> None:
    client, fake = make(tokenizer)
    fake.error = ("the worker failed it", 400)
    r = client.post(PATH, json={"model": MODEL, "input": "hi", "stream": True})
    assert r.status_code == 400 and r.json()["error"]["message"] == "the worker failed it"


def test_an_error_mid_stream_is_an_error_event_then_failed(tokenizer) -> None:
    client, fake = make(tokenizer)
    fake.error, fake.error_after_events = ("worker lost", 503), 2
    events = stream_events(client, {"model": MODEL, "input": "hi"})
    error, failed = events[-2:]
    assert error["type"] == "error" and error["message"] == "worker lost"
    assert error["code"] == "server_error" and "param" in error
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "worker lost"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_background_response_is_polled_to_its_end(tokenizer) -> None:
    client, fake = make(tokenizer, delay_s=0.01)
    with client:  # one event loop for all requests, as a server has: the task outlives its request
        _poll_background(client, fake)


def _poll_background(client: TestClient, fake: Any) -> None:
    r = client.post(PATH, json={"model": MODEL, "input": "hi", "background": True})
    assert r.status_code == 200, r.text
    queued = r.json()
    assert queued["status"] == "queued" and queued["background"] and queued["output"] == []
    assert fake.wait_until(lambda: fake.finished, WAIT_S)
    for _ in range(200):  # the store write follows the last token
        body = client.get(f"{PATH}/{queued['id']}").json()
        if body["status"] == "completed":
            break
    assert body["status"] == "completed" and output_text(body) == DEFAULT_REPLY
    assert client.post(f"{PATH}/{queued['id']}/cancel").json()["status"] == "completed"


def test_cancel_aborts_a_background_response_on_the_workers(tokenizer) -> None:
    client, fake = make(tokenizer)
    with client:
        _cancel_background(client, fake)


def _cancel_background(client: TestClient, fake: Any) -> None:
    fake.stall_after_events = 1
    queued = client.post(PATH, json={"model": MODEL, "input": "hi", "background": True}).json()
    assert fake.wait_until(lambda: fake.requests, WAIT_S)
    rid = fake.requests[-1][0]
    running = client.get(f"{PATH}/{queued['id']}").json()
    assert running["status"] in ("queued", "in_progress")
    cancelled = client.post(f"{PATH}/{queued['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert fake.wait_until(lambda: rid in fake.aborted, WAIT_S)
    assert client.get(f"{PATH}/{queued['id']}").json()["status"] == "cancelled"
    fake.stall_after_events = None
    sync = client.post(PATH, json={"model": MODEL, "input": "hi", "max_output_tokens": 16}).json()
    r = client.post(f"{PATH}/{sync['id']}/cancel")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id", r.text


def test_store_false_keeps_nothing_and_delete_removes(app) -> None:
    client, _ = app
    gone = client.post(PATH, json={"model": MODEL, "input": "hi", "store": False}).json()
    assert gone["store"] is False
    r = client.get(f"{PATH}/{gone['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    kept = client.post(PATH, json={"model": MODEL, "input": "hi"}).json()
    r = client.delete(f"{PATH}/{kept['id']}")
    assert r.json() == {"id": kept["id"], "object": "response", "deleted": True}
    assert client.get(f"{PATH}/{kept['id']}").status_code == 404
    assert client.delete(f"{PATH}/{kept['id']}").status_code == 404


def test_one_tenant_never_reaches_another_tenants_response(tokenizer) -> None:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)
    app = create_app(fake, tokenizer, MODEL, 2048, [tokenizer.eos_token_id])
    keys = KeyRing([ApiKey(b"Bearer key-a", "alice"), ApiKey(b"Bearer key-b", "bob")])
    install_guard(app, keys, 0)
    client = TestClient(app)
    alice, bob = ({"Authorization": f"Bearer key-{k}"} for k in "ab")
    made = client.post(PATH, json={"model": MODEL, "input": "secret"}, headers=alice).json()
    rid = made["id"]
    for method, path in (("GET", f"{PATH}/{rid}"), ("GET", f"{PATH}/{rid}/input_items"),
                         ("POST", f"{PATH}/{rid}/cancel"), ("DELETE", f"{PATH}/{rid}")):
        r = client.request(method, path, headers=bob)
        assert r.status_code == 404, (method, path, r.text)
    r = client.post(PATH, json={"model": MODEL, "input": "more", "previous_response_id": rid},
                    headers=bob)
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    assert client.get(f"{PATH}/{rid}", headers=alice).json() == made


# ---- the openai client ------------------------------------------------------------------------


@pytest.fixture
def api(tokenizer):
    import openai

    client, fake = make(tokenizer, reply=CALL)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                         http_client=client), fake


def test_openai_client_calls(api, tokenizer) -> None:
    import openai
    import pydantic

    client, fake = api
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    (call,) = r.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output[0].parsed_arguments == {"city": "Paris"}

    class City(pydantic.BaseModel):
        city: str

    fake.reply_ids = tokenizer.encode('{"city": "Paris"}', add_special_tokens=False)
    parsed = client.responses.parse(model=MODEL, input="Where?", text_format=City)
    assert parsed.output_parsed == City(city="Paris")
    assert client.responses.retrieve(parsed.id).output_text == '{"city": "Paris"}'
    items = client.responses.input_items.list(parsed.id)
    assert [i.type for i in items.data] == ["message"]
    client.responses.delete(parsed.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(parsed.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools[0].type"
