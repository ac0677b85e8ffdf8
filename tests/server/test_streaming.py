"""Streamed answers (SSE) on the fake engine: chunk shapes and finish reasons, the usage chunk,
and logprobs split over the chunks."""

from __future__ import annotations

import pytest

from splitserve.server.fake_client import DEFAULT_REPLY
from tests.http_api import CH, MODEL, USER, sse_events, streamed_text


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
