"""A client that goes away aborts its request on the engine: mid-stream with no next token to
send, and before the first token (queued or prefilling), streamed or not."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable

import httpx
import pytest

from tests.http_api import MODEL, WAIT_S


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
