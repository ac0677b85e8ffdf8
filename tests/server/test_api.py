"""The HTTP API against the deterministic fake engine: shapes, streaming, stop strings, errors."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import DEFAULT_REPLY, FakeEngineClient
from splitserve.server.main import create_server
from splitserve.server.routes import create_app
from splitserve.server.sse import iter_events

MODEL = "smol-test"
CONTEXT_LEN = 256
USER = [{"role": "user", "content": "Say hi"}]
# How long a test waits for something the server must do (start, abort a request): only a
# failing test waits this long, so it is generous, for a busy machine.
WAIT_S = 30.0


@pytest.fixture
def fake(tokenizer) -> FakeEngineClient:
    return FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)


@pytest.fixture
def client(fake, tokenizer) -> TestClient:
    app = create_app(fake, tokenizer, MODEL, CONTEXT_LEN, [tokenizer.eos_token_id])
    return TestClient(app)


def sse_events(text: str) -> list[dict | str]:
    """Parse an SSE body into JSON objects, with "[DONE]" kept as a string; every event must be a
    single ``data: `` line."""
    for block in text.split("\n\n"):
        assert not block.strip() or (block.startswith("data: ") and "\n" not in block), block
    return list(iter_events(text.splitlines()))


def streamed_text(events: list[dict | str], is_chat: bool) -> str:
    out = ""
    for ev in events:
        if isinstance(ev, dict) and ev.get("choices"):
            choice = ev["choices"][0]
            out += (choice["delta"].get("content") or "") if is_chat else choice["text"]
    return out


# ---- happy paths -----------------------------------------------------------------------------


def test_completion(client, fake, tokenizer) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon"})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"index": 0, "text": DEFAULT_REPLY, "finish_reason": "stop", "logprobs": None}
    ]
    prompt_len = len(tokenizer.encode("Once upon"))
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": len(fake.reply_ids) + 1,  # + EOS
        "total_tokens": prompt_len + len(fake.reply_ids) + 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    _, _, sampling = fake.requests[-1]
    assert sampling.max_new_tokens == CONTEXT_LEN - prompt_len  # default: the rest of context
    assert sampling.stop_token_ids == [tokenizer.eos_token_id]


def test_completion_token_id_prompts(client, fake) -> None:
    for prompt in ([10, 20, 30], [[10, 20, 30]], ["hi"]):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 200, r.text
    assert fake.requests[0][1] == [10, 20, 30] == fake.requests[1][1]


def test_chat(client, fake, tokenizer) -> None:
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": DEFAULT_REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"
    text = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    input_ids = fake.requests[-1][1]
    assert input_ids == tokenizer.encode(text, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(input_ids)
    # The template's own BOS (if any) is not doubled by the encoder.
    bos = tokenizer.bos_token_id
    assert bos is None or input_ids[:2] != [bos, bos]


def test_chat_text_parts_and_developer_role(client, fake) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}],
        },
    ]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    assert (
        client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}).status_code
        == 200
    )
    assert (
        client.post("/v1/chat/completions", json={"model": MODEL, "messages": plain}).status_code
        == 200
    )
    assert fake.requests[0][1] == fake.requests[1][1]


def test_model_alias_and_sampling_fields(client, fake) -> None:
    body = {
        "model": "default",
        "prompt": "x",
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 7,
        "min_p": 0.1,
        "seed": 42,
        "user": "someone",  # unknown OpenAI fields are ignored
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 5
    s = fake.requests[-1][2]
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (
        5,
        0.0,
        0.5,
        7,
        0.1,
        42,
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_penalty_fields_reach_the_engine(client, fake, path) -> None:
    body = {"model": MODEL, "max_tokens": 5, "presence_penalty": 0.5, "frequency_penalty": -1,
            "repetition_penalty": 1.2, "logit_bias": {"7": -100, "12": 3.5}, "min_tokens": 2,
            "stop_token_ids": [9, 11], "ignore_eos": True}
    body |= {"prompt": "x"} if path == C else {"messages": USER}
    assert client.post(path, json=body).status_code == 200
    s = fake.requests[-1][2]
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.2)
    assert s.logit_bias == {7: -100.0, 12: 3.5} and s.min_tokens == 2
    assert s.stop_token_ids == [9, 11]  # ignore_eos drops EOS, not the request's own stop ids
    assert s.top_logprobs == 0


def test_top_logprobs_reach_the_engine(client, fake) -> None:
    chat = {"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 4}
    assert client.post(CH, json=chat).status_code == 200
    assert fake.requests[-1][2].top_logprobs == 4
    r = client.post(CH, json={**chat, "logprobs": False, "top_logprobs": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    assert fake.requests[-1][2].top_logprobs == 0
    assert client.post(C, json={"model": MODEL, "prompt": "x", "logprobs": 3}).status_code == 200
    assert fake.requests[-1][2].top_logprobs == 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_logprobs_cover_every_token_once(client, fake, path) -> None:
    """Each chunk carries the logprobs of its own tokens: joined, they are the whole answer's
    (legacy text offsets running on across chunks)."""
    body = {"model": MODEL, "max_tokens": 12, "logprobs": True if path == CH else 2}
    body |= {"messages": USER, "top_logprobs": 2} if path == CH else {"prompt": "x"}
    full = client.post(path, json=body).json()["choices"][0]["logprobs"]
    events = sse_events(client.post(path, json={**body, "stream": True}).text)
    chunks = [e["choices"][0]["logprobs"] for e in events
              if isinstance(e, dict) and e["choices"] and e["choices"][0]["logprobs"]]
    assert len(chunks) > 1
    if path == CH:
        assert [t for c in chunks for t in c["content"]] == full["content"]
        assert len(full["content"]) == 12 and all("bytes" in t for t in full["content"])
    else:
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for c in chunks for x in c[key]] == full[key], key
        assert len(full["tokens"]) == 12
        assert full["text_offset"] == sorted(full["text_offset"])


def test_ignore_eos_and_max_completion_tokens(client, fake) -> None:
    body = {"model": MODEL, "messages": USER, "ignore_eos": True, "max_completion_tokens": 40}
    r = client.post("/v1/chat/completions", json={**body, "max_tokens": 3})
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 40
    assert r.json()["choices"][0]["message"]["content"].startswith(DEFAULT_REPLY + "Hello")
    s = fake.requests[-1][2]
    assert s.ignore_eos and s.stop_token_ids == [] and s.max_new_tokens == 40


def test_cached_tokens_reported(client) -> None:
    req = {"model": MODEL, "messages": USER}
    client.post("/v1/chat/completions", json=req)
    usage = client.post("/v1/chat/completions", json=req).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]


# ---- streaming -------------------------------------------------------------------------------


def test_stream_completion(client) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert streamed_text(events, is_chat=False) == DEFAULT_REPLY
    chunks = [e for e in events if isinstance(e, dict)]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all("\ufffd" not in c["choices"][0]["text"] for c in chunks)


def test_stream_chat_with_usage(client, fake) -> None:
    req = {
        "model": MODEL,
        "messages": USER,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = sse_events(client.post("/v1/chat/completions", json=req).text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert streamed_text(events, is_chat=True) == DEFAULT_REPLY
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == len(fake.reply_ids) + 1
    assert all(c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


# ---- stop strings ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client, fake, stream: bool) -> None:
    req = {"model": MODEL, "prompt": "hi", "stop": ["世界", "zzz"], "stream": stream}
    r = client.post("/v1/completions", json=req)
    assert r.status_code == 200
    cut = DEFAULT_REPLY[: DEFAULT_REPLY.index("世界")]
    if stream:
        events = sse_events(r.text)
        assert streamed_text(events, is_chat=False) == cut
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
    else:
        assert r.json()["choices"][0] == {
            "index": 0,
            "text": cut,
            "finish_reason": "stop",
            "logprobs": None,
        }
    rid = fake.requests[-1][0]
    assert rid in fake.aborted and rid not in fake.finished  # stopped early: engine aborted


def test_single_stop_string_in_chat(client) -> None:
    req = {"model": MODEL, "messages": USER, "stop": " fake"}
    r = client.post("/v1/chat/completions", json=req)
    assert r.json()["choices"][0]["message"]["content"] == "Hello from the"


# ---- bad input -------------------------------------------------------------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS = [
    (C, {"prompt": "hi"}, "model"),
    (C, {"model": "gpt-4", "prompt": "hi"}, "model"),
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


@pytest.mark.parametrize("raw", [b"{bad json", b"[1, 2]", b"", b"null"])
def test_malformed_body_is_400(client, raw: bytes) -> None:
    r = client.post(C, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


# ---- worker errors ---------------------------------------------------------------------------


def test_worker_error_non_streaming(client, fake) -> None:
    fake.error, fake.error_after_events = ("no room for the prompt", 503), 1
    r = client.post(C, json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "no room for the prompt"
    assert r.json()["error"]["type"] == "server_error"


def test_worker_error_before_first_token_streaming_is_plain_error(client, fake) -> None:
    fake.error = ("grammar failed to compile", 400)
    r = client.post(C, json={"model": MODEL, "prompt": "hi", "stream": True})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "grammar failed to compile"


def test_worker_error_mid_stream_is_sse_error_event(client, fake) -> None:
    fake.error, fake.error_after_events = ("decode worker died", 500), 2
    r = client.post(CH, json={"model": MODEL, "messages": USER, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2] == {
        "error": {
            "message": "decode worker died",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }


# ---- other endpoints -------------------------------------------------------------------------


def test_health_models_workers(client, fake) -> None:
    assert client.get("/health").status_code == 200
    fake.ready = False
    assert client.get("/health").status_code == 503
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/v1/models/other").status_code == 404
    assert client.get("/workers").json()[0]["role"] == "colocated"
    assert client.get("/nowhere").json()["error"]["type"] == "not_found_error"


# ---- a real server: the openai client, and a client that goes away ----------------------------


@pytest.fixture
def live_server(fake, tokenizer) -> Iterator[str]:
    app = create_app(fake, tokenizer, MODEL, CONTEXT_LEN, [tokenizer.eos_token_id])
    server = create_server(app, "127.0.0.1", 0, log_level="warning")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here so the port is known and free of races
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_openai_client(live_server) -> None:
    import openai

    api = openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0)
    chat = api.chat.completions.create(model=MODEL, messages=USER, max_tokens=50)
    assert chat.choices[0].message.content == DEFAULT_REPLY
    assert chat.usage.prompt_tokens_details.cached_tokens == 0

    stream = api.chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == DEFAULT_REPLY and chunks[-1].usage.completion_tokens > 0

    comp = api.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert comp.choices[0].finish_reason == "length"
    assert [m.id for m in api.models.list()] == [MODEL]

    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt="hi", temperature=9)
    assert info.value.body["param"] == "temperature"


def test_client_disconnect_aborts_request(live_server, fake) -> None:
    # After its first event the engine sends nothing more until the request is aborted (a long
    # wait between tokens): the abort must come from noticing the disconnect, as there is no
    # next send to fail.
    fake.stall_after_events = 1
    req = {"model": MODEL, "prompt": "hi", "ignore_eos": True, "max_tokens": 200, "stream": True}
    with (
        httpx.Client(base_url=live_server, timeout=WAIT_S) as http,
        http.stream("POST", "/v1/completions", json=req) as r,
    ):
        assert next(r.iter_lines()).startswith("data: ")
    rid = fake.requests[-1][0]
    assert fake.wait_until(lambda: rid in fake.aborted, WAIT_S), (
        "request was not aborted when the client left")
    assert rid not in fake.finished


def post_then_leave(base_url: str, path: str, body: dict, until: Callable[[], bool]) -> None:
    """POST ``body`` on a raw connection and close it, unanswered, once ``until()`` holds."""
    host, port = base_url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(head.encode() + data)
        assert until(), "the request did not reach the engine"


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_before_the_first_token_aborts_request(live_server, fake, stream) -> None:
    """A client that gives up while the request is still queued or prefilling (no token yet;
    non-streaming: no byte of the response at all) must not leave it running on the workers."""
    fake.stall_after_events = 0  # no event until the request is aborted
    req = {"model": MODEL, "prompt": "hi", "ignore_eos": True, "max_tokens": 200, "stream": stream}
    post_then_leave(live_server, "/v1/completions", req,
                    until=lambda: fake.wait_until(lambda: fake.requests, WAIT_S))
    rid = fake.requests[-1][0]
    assert fake.wait_until(lambda: rid in fake.aborted, WAIT_S), (
        "request was not aborted when the client left")
    assert rid not in fake.finished
    # The server still answers.
    fake.stall_after_events = None
    with httpx.Client(base_url=live_server, timeout=WAIT_S) as http:
        r = http.post("/v1/completions", json={**req, "max_tokens": 4})
    assert r.status_code == 200


def test_fastapi_validation_errors_are_400(fake, tokenizer) -> None:
    # Routes added later with typed parameters get the OpenAI shape too, not FastAPI's 422.
    app = create_app(fake, tokenizer, MODEL, CONTEXT_LEN, [tokenizer.eos_token_id])

    @app.get("/typed")
    async def typed(limit: int) -> dict:
        return {"limit": limit}

    r = TestClient(app).get("/typed", params={"limit": "many"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "query.limit"
