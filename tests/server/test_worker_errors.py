"""Errors from the workers: a plain error response when no byte has been sent yet (streamed or
not), an SSE error event once a stream has begun."""

from __future__ import annotations

from tests.http_api import CH, MODEL, USER, C, sse_events


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
