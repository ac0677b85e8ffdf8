"""Every endpoint that builds a chat job prepares it through the app's ``server.offload``:
Responses and Anthropic's Messages (and ``count_tokens``) as chat completions do, so a huge
body is parsed, translated, templated and tokenized off the event loop. A full offload queue
answers 503 with ``Retry-After`` in each API's own error shape."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.offload import Offload
from splitserve.server.routes import create_app
from tests.http_api import CH, MODEL, USER
from tests.messages_api import check_anthropic_error

MESSAGES = ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": USER})
COUNT = ("/v1/messages/count_tokens", {"model": MODEL, "messages": USER})
RESPONSES = ("/v1/responses", {"model": MODEL, "input": "Say hi", "max_output_tokens": 16})
CHAT = (CH, {"model": MODEL, "messages": USER, "max_tokens": 8})


class RecordingOffload(Offload):
    """An offload that records the name of each call it runs and the thread it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bool]] = []  # (function, ran on another thread)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop_thread = threading.current_thread()

        def recorded(*a: Any) -> Any:
            self.calls.append((fn.__name__, threading.current_thread() is not loop_thread))
            return fn(*a)

        return await super().run(recorded, *args)


def _client(tokenizer, offload: Offload) -> TestClient:
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)
    return TestClient(create_app(fake, tokenizer, MODEL, 2048, [tokenizer.eos_token_id],
                                 offload=offload))


@pytest.mark.parametrize("path,body", [CHAT, RESPONSES, MESSAGES, COUNT],
                         ids=["chat", "responses", "messages", "count_tokens"])
def test_parsing_and_the_job_run_on_the_offload_threads(tokenizer, path: str, body: dict) -> None:
    offload = RecordingOffload()
    r = _client(tokenizer, offload).post(path, json=body)
    assert r.status_code == 200, r.text
    names = [name for name, _ in offload.calls]
    # First the body (parsed and checked), then the job (translated, templated, tokenized).
    assert names[0] == "parse_body" and len(names) >= 2, names
    assert all(off_loop for _, off_loop in offload.calls), offload.calls


def test_a_bad_body_is_refused_from_the_offload_in_its_apis_shape(tokenizer) -> None:
    offload = RecordingOffload()
    client = _client(tokenizer, offload)
    r = client.post("/v1/messages", json={**MESSAGES[1], "bogus": 1})
    assert "bogus" in check_anthropic_error(r.status_code, r.text)["message"]
    assert r.status_code == 400
    r = client.post("/v1/responses", json={**RESPONSES[1], "tools": [{"type": "web_search"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].type", r.text
    assert [name for name, _ in offload.calls] == ["parse_body", "parse_body"]


@pytest.mark.parametrize("path,body", [RESPONSES, MESSAGES, COUNT],
                         ids=["responses", "messages", "count_tokens"])
def test_a_full_offload_queue_is_503_with_retry_after(tokenizer, path: str, body: dict) -> None:
    offload = Offload(num_threads=1, max_pending=1)
    offload.pending = offload.max_pending  # as if one request were being prepared
    r = _client(tokenizer, offload).post(path, json=body)
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    if path.startswith("/v1/messages"):
        assert "busy" in check_anthropic_error(503, r.text)["message"]
    else:
        assert r.json()["error"]["code"] == "server_busy", r.text
