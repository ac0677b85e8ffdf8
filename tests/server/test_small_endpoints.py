"""The small endpoints users expect (vLLM's shapes): /tokenize, /detokenize, /version,
/v1/models/{id}; the X-Request-Id header; CORS from --allowed-origins."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from splitserve.config import ServeConfig
from splitserve.config.flags import SERVER_FLAGS, add_flags, apply_flags
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.main import install_cors
from splitserve.server.routes import create_app

MODEL = "smol-test"
CONTEXT_LEN = 256
USER = [{"role": "user", "content": "Say hi"}]


def make_app(tokenizer, allowed_origins=()):
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)
    return create_app(fake, tokenizer, MODEL, CONTEXT_LEN, [tokenizer.eos_token_id],
                      allowed_origins=allowed_origins)


@pytest.fixture(scope="module")
def client(tokenizer) -> TestClient:
    return TestClient(make_app(tokenizer))


def test_tokenize_prompt_counts_what_a_completion_uses(client, tokenizer) -> None:
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "The capital of France"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("The capital of France")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == CONTEXT_LEN
    used = client.post("/v1/completions", json={"model": MODEL, "prompt": "The capital of France",
                                                 "max_tokens": 1}).json()["usage"]
    assert used["prompt_tokens"] == body["count"]
    no_special = client.post("/tokenize", json={"prompt": "The capital of France",
                                                "add_special_tokens": False}).json()
    assert no_special["tokens"] == tokenizer.encode("The capital of France",
                                                    add_special_tokens=False)


def test_tokenize_messages_renders_the_chat_template(client, tokenizer) -> None:
    r = client.post("/tokenize", json={"model": "default", "messages": USER})
    assert r.status_code == 200, r.text
    text = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    used = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                      "max_tokens": 1}).json()["usage"]
    assert used["prompt_tokens"] == r.json()["count"]


def test_detokenize_inverts_tokenize(client, tokenizer) -> None:
    ids = client.post("/tokenize", json={"prompt": "héllo 世界", "add_special_tokens": False}
                      ).json()["tokens"]
    r = client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "héllo 世界"}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "nobody", "content": "x"}]}, "messages[0].role"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_bad_input_is_a_400_naming_the_field(client, path, body, param) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body"), [
    ("/tokenize", {"model": "other", "prompt": "x"}),
    ("/detokenize", {"model": "other", "tokens": [1]}),
])
def test_tokenize_unknown_model_is_404(client, path, body) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found" and "'other'" in r.text


def test_tokenize_needs_a_json_object(client) -> None:
    for content in (b"[1, 2]", b"{nope", b'{"prompt": "a\\ud800b"}'):  # a lone surrogate
        r = client.post("/tokenize", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_version(client) -> None:
    from importlib.metadata import version

    assert client.get("/version").json() == {"version": version("splitserve")}


def test_model_by_id(client) -> None:
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/v1/models/default").status_code == 200
    r = client.get("/v1/models/org/other-model")  # ids may hold slashes
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": r.json()["error"]["message"], "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}
    assert "org/other-model" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_request_id_is_echoed_and_starts_the_rid(tokenizer, stream: bool) -> None:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)
    client = TestClient(create_app(fake, tokenizer, MODEL, CONTEXT_LEN, [tokenizer.eos_token_id]))
    r = client.post("/v1/chat/completions", headers={"X-Request-Id": "trace-42"},
                    json={"model": MODEL, "messages": USER, "stream": stream})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    rid, _, _ = fake.requests[-1]
    assert rid.startswith("trace-42-")  # the workers and logs see the client's id
    if not stream:
        assert r.json()["id"] == rid
    # A reused id is still a distinct request on the workers.
    client.post("/v1/completions", headers={"X-Request-Id": "trace-42"},
                json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert fake.requests[-1][0] != rid and fake.requests[-1][0].startswith("trace-42-")


def test_request_id_on_errors_and_without_one(client) -> None:
    r = client.post("/v1/completions", headers={"X-Request-Id": "e-1"},
                    json={"model": MODEL, "prompt": "x", "suffix": "y"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "e-1"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert "x-request-id" not in r.headers and r.json()["id"].startswith("cmpl-")


@pytest.mark.parametrize("bad", ["has space", "x" * 129, "tab\tid", "é"])
def test_bad_request_id_is_a_400_naming_the_header(client, bad: str) -> None:
    r = client.post("/v1/completions", headers={"X-Request-Id": bad.encode("utf-8")},
                    json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "X-Request-Id"


def parse_server_flags(argv: list[str]) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_flags(parser, SERVER_FLAGS)
    config = ServeConfig()
    apply_flags(parser.parse_args(argv), config, SERVER_FLAGS)
    return config


def test_allowed_origins_flag() -> None:
    assert parse_server_flags([]).server.allowed_origins == []
    config = parse_server_flags(["--allowed-origins", "http://a.test,http://b.test", "http://c"])
    assert config.server.allowed_origins == ["http://a.test", "http://b.test", "http://c"]


def test_cors(tokenizer) -> None:
    preflight = {"Origin": "http://app.test", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    app = make_app(tokenizer)
    install_cors(app, [])  # the default: no CORS headers
    plain = TestClient(app)
    assert "access-control-allow-origin" not in plain.get(
        "/v1/models", headers={"Origin": "http://app.test"}).headers
    assert plain.options("/v1/chat/completions", headers=preflight).status_code != 200
    from splitserve.server.guard import install_guard

    app = make_app(tokenizer, ["http://app.test"])  # as server.main builds it
    install_guard(app, "sekret", 0)
    install_cors(app, ["http://app.test"])
    client = TestClient(app)
    r = client.options("/v1/chat/completions", headers=preflight)  # no key on a preflight
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.test"
    r = client.get("/v1/models", headers={"Origin": "http://app.test",
                                          "Authorization": "Bearer sekret"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.test"
    r = client.options("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.test"})
    assert r.headers.get("access-control-allow-origin") != "http://evil.test"
