"""Bad input is a 400 in OpenAI's error shape, naming the field, and reaches no engine: bad
fields, malformed bodies, and FastAPI's own validation errors."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from splitserve.server.routes import create_app
from tests.http_api import CH, CONTEXT_LEN, MODEL, USER, C

BAD_REQUESTS = [
    (C, {"prompt": "hi"}, "model"),
    (C, {"model": MODEL}, "prompt"),
    (C, {"model": MODEL, "prompt": 5}, "prompt"),
    (C, {"model": MODEL, "prompt": ["a", "b"], "stream": True}, "prompt"),
    (C, {"model": MODEL, "prompt": ["a", 5]}, "prompt"),
    (C, {"model": MODEL, "prompt": ["a"] * 65}, "prompt"),
    (C, {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    (C, {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    (C, {"model": MODEL, "prompt": "hi", "logit_bias": {"5": "1"}}, "logit_bias"),
    (C, {"model": MODEL, "prompt": "hi", "logit_bias": {"10000000": 1}}, "logit_bias"),
    (C, {"model": MODEL, "prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    (C, {"model": MODEL, "prompt": "hi", "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    (C, {"model": MODEL, "prompt": "hi", "min_tokens": -1}, "min_tokens"),
    (C, {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    (C, {"model": MODEL, "prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    (C, {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    (C, {"model": MODEL, "prompt": "hi", "logprobs": 6}, "logprobs"),
    (C, {"model": MODEL, "prompt": "hi", "echo": True, "stream": True}, "stream"),
    (CH, {"model": MODEL, "messages": USER, "top_logprobs": 2}, "top_logprobs"),
    (CH, {"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    (C, {"model": MODEL, "prompt": ""}, "prompt"),
    (C, {"model": MODEL, "prompt": [10**7]}, "prompt"),
    (C, {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (C, {"model": MODEL, "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    (C, {"model": MODEL, "prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    (C, {"model": MODEL, "prompt": "hi", "max_tokens": 10_000}, "max_tokens"),
    (C, {"model": MODEL, "prompt": "hi", "temperature": 2.5}, "temperature"),
    (C, {"model": MODEL, "prompt": "hi", "temperature": -0.1}, "temperature"),
    (C, {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    (C, {"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
    (C, {"model": MODEL, "prompt": "hi", "top_k": -2}, "top_k"),
    (C, {"model": MODEL, "prompt": "hi", "n": 17}, "n"),
    (C, {"model": MODEL, "prompt": "hi", "best_of": 2}, "best_of"),
    (C, {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (C, {"model": MODEL, "prompt": "hi", "stop": 3}, "stop"),
    (C, {"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream"),
    (C, {"model": MODEL, "prompt": "word " * 300}, "prompt"),
    (CH, {"model": MODEL}, "messages"),
    (CH, {"model": MODEL, "messages": []}, "messages"),
    (CH, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CH, {"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content"),
    (CH, {"model": MODEL, "messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    (
        CH,
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content",
    ),
    (
        CH,
        {"model": MODEL, "messages": USER, "max_completion_tokens": 10_000},
        "max_completion_tokens",
    ),
    (CH, {"model": MODEL, "messages": [{"role": "user", "content": "w " * 300}]}, "messages"),
    (
        CH,
        {"model": MODEL, "messages": USER, "response_format": {"type": "json_schema", "json_schema": {
            "name": "tags", "strict": True,
            "schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}},
        "response_format",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_request_is_400_naming_the_field(
    client, fake, path: str, body: dict, param: str
) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    # A field the table refuses (server.fields) is "unsupported_parameter"; a bad value, None.
    assert err["type"] == "invalid_request_error" and err["code"] in (None, "unsupported_parameter")
    assert err["param"] == param and param.split("[")[0] in err["message"]
    assert fake.requests == []  # nothing reached the engine
    good = {"model": MODEL, "prompt": "hi"} if path == C else {"model": MODEL, "messages": USER}
    assert client.post(path, json=good).status_code == 200


@pytest.mark.parametrize("path", [C, CH])
def test_unknown_model_is_404_naming_it(client, fake, path: str) -> None:
    """A ``model`` that is neither the base model nor a served LoRA adapter: 404
    ``model_not_found`` (OpenAI's and vLLM's answer), naming it and what is served."""
    body = {"model": "gpt-4", "prompt": "hi"} if path == C else {"model": "gpt-4",
                                                                 "messages": USER}
    r = client.post(path, json=body)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "'gpt-4'" in err["message"] and MODEL in err["message"]
    assert fake.requests == []


TOOLS = [{"type": "function", "function": {"name": "f"}}]
# A value that matches no member of a union field: the param is where it sits in the body, not
# pydantic's member tag (``tool_choice.literal['none','auto','required']``), and the error is
# the member's the value was written for (a named choice's bad name, not "should be 'auto'").
UNION_ERRORS = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": 5}}},
     "tool_choice.function.name", "valid string"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "f"}},
     "tool_choice.function", "object|dictionary"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function", "required"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name", "required"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "'auto'"),
    ({"tools": TOOLS, "tool_choice": 5}, "tool_choice", "'auto'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 5}}},
     "response_format.json_schema.schema", "object|dictionary"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}},
     "response_format.json_schema.schema", "object|dictionary"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "content is required"),
]


@pytest.mark.parametrize(("extra", "param", "says"), UNION_ERRORS)
@pytest.mark.parametrize("path", [CH, "/tokenize"])
def test_union_field_errors_name_the_body_path(client, fake, path, extra, param, says) -> None:
    r = client.post(path, json={"model": MODEL, "messages": USER, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(f"{param}: "), err
    assert any(s in err["message"] for s in says.split("|")), err  # /tokenize: "dictionary"
    assert fake.requests == []


@pytest.mark.parametrize("raw", [b"{bad json", b"[1, 2]", b"", b"null"])
def test_malformed_body_is_400(client, raw: bytes) -> None:
    r = client.post(C, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_fastapi_validation_errors_are_400(fake, tokenizer) -> None:
    # Routes added later with typed parameters get the OpenAI shape too, not FastAPI's 422.
    app = create_app(fake, tokenizer, MODEL, CONTEXT_LEN, [tokenizer.eos_token_id])

    @app.get("/typed")
    async def typed(limit: int) -> dict:
        return {"limit": limit}

    r = TestClient(app).get("/typed", params={"limit": "many"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "query.limit"
