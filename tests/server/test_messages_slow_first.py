"""A Messages stream whose first token is slow (an agent's long prompt prefilled on a CPU) starts
without it and pings until it comes, as Anthropic's API keeps a slow stream alive, instead of
sending nothing for minutes (Claude Code gave up at 303 s and sent the request again). Served by
uvicorn so that the events are read as they are sent; the slow prefill is the fake engine's
first event held until the test has seen the pings."""

from __future__ import annotations

import httpx
import pytest

from splitserve.server.messages_api import answer
from splitserve.server.messages_api.errors import error_body
from tests.http_api import MODEL, held_first_app, served, sse_blocks

BODY = {"model": MODEL, "max_tokens": 16, "stream": True,
        "messages": [{"role": "user", "content": "Say hi."}]}


@pytest.fixture
def fake_app(tokenizer, monkeypatch):
    monkeypatch.setattr(answer, "FIRST_PIECE_WAIT_S", 0.0)
    monkeypatch.setattr(answer, "PING_S", 0.02)
    with held_first_app(tokenizer, "Hello there.") as fake_and_app:
        yield fake_and_app


def _events(lines):
    return (data for _, data in sse_blocks(lines))


def test_stream_starts_and_pings_while_the_first_token_is_slow(fake_app) -> None:
    fake, app = fake_app
    with served(app) as url, httpx.stream("POST", url + "/v1/messages", json=BODY,
                                          timeout=60) as r:
        assert r.status_code == 200
        events = _events(r.iter_lines())
        seen = [next(events)["type"] for _ in range(4)]
        # Headers, message_start and pings went out while the first token had not come.
        assert seen == ["message_start", "ping", "ping", "ping"]
        assert not fake.hold_first.is_set()
        fake.hold_first.set()
        rest = [e for e in events if e["type"] != "ping"]
    text = "".join(e["delta"].get("text", "") for e in rest if e["type"] == "content_block_delta")
    assert text == "Hello there."
    assert [e["type"] for e in rest][-2:] == ["message_delta", "message_stop"]
    assert rest[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens")


def test_an_error_while_waiting_is_an_error_event_and_a_fast_one_a_status(
        fake_app, monkeypatch) -> None:
    fake, app = fake_app
    fake.error = ("the worker failed", 503)
    with served(app) as url:
        with httpx.stream("POST", url + "/v1/messages", json=BODY, timeout=60) as r:
            assert r.status_code == 200  # the stream had started before the error
            events = _events(r.iter_lines())
            assert next(events)["type"] == "message_start"
            fake.hold_first.set()
            last = [e for e in events if e["type"] != "ping"]
        assert last == [error_body(503, "the worker failed")]
        # Within the wait the error is still the plain status.
        monkeypatch.setattr(answer, "FIRST_PIECE_WAIT_S", 30.0)
        r = httpx.post(url + "/v1/messages", json=BODY, timeout=60)
        assert r.status_code == 503 and r.json() == error_body(503, "the worker failed")


def test_a_client_leaving_while_waiting_aborts_the_request(fake_app) -> None:
    fake, app = fake_app
    with served(app) as url:
        with httpx.stream("POST", url + "/v1/messages", json=BODY, timeout=60) as r:
            events = _events(r.iter_lines())
            assert next(events)["type"] == "message_start"
            assert next(events)["type"] == "ping"
        # The stream was closed before its first token: the engine request is aborted.
        assert fake.wait_until(lambda: len(fake.aborted) == 1, timeout_s=30), fake.aborted
