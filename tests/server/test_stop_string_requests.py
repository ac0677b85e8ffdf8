"""Stop strings in requests, streamed or not: the answer cut before the stop, and the engine's
request aborted. The matcher itself is tested in test_stop_strings.py."""

from __future__ import annotations

import pytest

from splitserve.server.fake_client import DEFAULT_REPLY
from tests.http_api import MODEL, USER, sse_events, streamed_text


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
