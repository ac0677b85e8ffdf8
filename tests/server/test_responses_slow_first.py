"""A streamed response whose first token is slow (an agent's long prompt prefilled on a CPU)
starts without it, with ``response.created`` and ``response.in_progress``, and sends an SSE
comment every few seconds until it comes, instead of nothing for minutes (Codex gives up after
300 s idle). The real ``openai`` client reads such a stream unchanged. Served by uvicorn so that
events are read as they are sent; the slow prefill is the fake engine's first event, held."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from splitserve.server.responses_api import routes as responses_routes
from splitserve.server.responses_api import run
from tests.http_api import MODEL, held_first_app, served, sse_blocks

BODY = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 16, "stream": True,
        "store": False}


@pytest.fixture
def fake_app(tokenizer, monkeypatch):
    monkeypatch.setattr(run, "FIRST_PIECE_WAIT_S", 0.0)
    monkeypatch.setattr(run, "KEEPALIVE_S", 0.02)
    with held_first_app(tokenizer, "Hello there.") as fake_and_app:
        yield fake_and_app


def test_stream_starts_and_keeps_alive_while_the_first_token_is_slow(fake_app) -> None:
    fake, app = fake_app
    with served(app) as url, httpx.stream("POST", url + "/v1/responses", json=BODY,
                                          timeout=60) as r:
        assert r.status_code == 200
        blocks = sse_blocks(r.iter_lines())
        seen = [next(blocks)[0] for _ in range(5)]
        assert seen == ["response.created", "response.in_progress", "comment", "comment",
                        "comment"]
        assert not fake.hold_first.is_set()
        fake.hold_first.set()
        rest = [(name, data) for name, data in blocks if name != "comment"]
    numbers = [data["sequence_number"] for _, data in rest]
    assert numbers == list(range(2, 2 + len(rest)))  # comments take no sequence number
    text = "".join(d["delta"] for n, d in rest if n == "response.output_text.delta")
    assert text == "Hello there."
    assert rest[-1][0] == "response.completed"


def test_an_error_while_waiting_is_an_error_event_and_a_fast_one_a_status(
        fake_app, monkeypatch) -> None:
    fake, app = fake_app
    fake.error = ("the worker failed", 503)
    with served(app) as url:
        with httpx.stream("POST", url + "/v1/responses", json=BODY, timeout=60) as r:
            assert r.status_code == 200  # the stream had started before the error
            blocks = sse_blocks(r.iter_lines())
            assert next(blocks)[0] == "response.created"
            fake.hold_first.set()
            last = [name for name, _ in blocks if name != "comment"]
        assert last[-2:] == ["error", "response.failed"]
        # Within the wait the error is still the plain status.
        monkeypatch.setattr(run, "FIRST_PIECE_WAIT_S", 30.0)
        r = httpx.post(url + "/v1/responses", json=BODY, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["message"] == "the worker failed"


def test_a_client_leaving_while_waiting_aborts_the_request(fake_app) -> None:
    fake, app = fake_app
    with served(app) as url:
        with httpx.stream("POST", url + "/v1/responses", json=BODY, timeout=60) as r:
            blocks = sse_blocks(r.iter_lines())
            assert next(blocks)[0] == "response.created"
            assert next(blocks)[0] == "response.in_progress"
        assert fake.wait_until(lambda: len(fake.aborted) == 1, timeout_s=30), fake.aborted


def test_the_openai_client_reads_a_kept_alive_stream(fake_app, monkeypatch) -> None:
    """``client.responses.create(stream=True)``: the comments sent while the first token was
    held are skipped by the client's own SSE parser; the events and text are whole."""
    fake, app = fake_app
    comments = threading.Event()
    sse_events = responses_routes.sse_events

    async def counted(*args, **kwargs):
        num = 0
        async for chunk in sse_events(*args, **kwargs):
            num += chunk.startswith(":")
            if num >= 3:
                comments.set()
            yield chunk

    monkeypatch.setattr(responses_routes, "sse_events", counted)
    with served(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=16,
                                         stream=True, store=False)
        kinds = []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.in_progress":
                assert comments.wait(30), "no keepalive comment while the first token was held"
                fake.hold_first.set()
            if event.type == "response.completed":
                text = event.response.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and text == "Hello there."
