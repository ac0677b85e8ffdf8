"""Overload and tenants at the HTTP layer, on the fake engine: the router's full queue is a 429
with ``Retry-After`` (and ``retry-after-ms``) in each endpoint's own error shape; a request
reaches the engine under its tenant; the token-rate limit charges generated tokens as each
event streams, not once the request ends; the key file's fair-queueing weights."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from fastapi.testclient import TestClient

from splitserve.ipc.messages import SamplingParams
from splitserve.server.engine_client import TokenEvent
from splitserve.server.errors import APIError
from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.formatter import ResponseFormatter, Usage
from splitserve.server.generation import stream_text
from splitserve.server.guard import install_guard
from splitserve.server.job import Job
from splitserve.server.rate_limit import RateLimiter
from splitserve.server.routes import create_app
from splitserve.server.tenancy import TENANT_SCOPE_KEY, KeyRing, Tenancy
from tests.messages_api import check_anthropic_error

USER = [{"role": "user", "content": "hi"}]
FULL = "server overloaded: 4 requests running on 4 slots and 8 waiting (limit 8)"


@pytest.fixture
def overloaded(tokenizer) -> tuple[TestClient, FakeEngineClient]:
    fake = FakeEngineClient(tokenizer, tokenizer.eos_token_id)
    fake.error, fake.error_retry_after_s = (FULL, 429), 2.4
    app = create_app(fake, tokenizer, "m", 2048, [tokenizer.eos_token_id])
    return TestClient(app), fake


def _check_retry(r) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "3" and r.headers["retry-after-ms"] == "2400"


@pytest.mark.parametrize("stream", [False, True])
def test_full_queue_is_429_in_openais_shape(overloaded, stream) -> None:
    client, _ = overloaded
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": USER})):
        r = client.post(path, json={"model": "m", "max_tokens": 4, "stream": stream, **body})
        _check_retry(r)
        assert r.json() == {"error": {"message": FULL, "type": "rate_limit_error",
                                      "param": None, "code": "server_overloaded"}}


@pytest.mark.parametrize("stream", [False, True])
def test_full_queue_is_429_in_anthropics_shape(overloaded, stream) -> None:
    client, _ = overloaded
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": USER,
                                          "stream": stream})
    _check_retry(r)
    assert check_anthropic_error(429, r.text)["message"] == FULL


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages",
                                  "/v1/responses"])
def test_a_queue_refusal_gives_the_rate_limit_back(tokenizer, path) -> None:
    """The rate limiter admits a request (one of 1 request/s, its prompt of 40 tokens/s), then
    the router's full queue refuses it: it never ran, so its admission is given back and the
    tenant's retries keep getting the queue's 429, not its own rate limit's. The clock never
    moves: without the refund the second request is ``rate_limit_exceeded``."""
    fake = FakeEngineClient(tokenizer, tokenizer.eos_token_id)
    fake.error, fake.error_retry_after_s = (FULL, 429), 2.4
    limiter = RateLimiter(requests_per_s=1, tokens_per_s=40, clock=lambda: 100.0)
    app = create_app(fake, tokenizer, "m", 2048, [tokenizer.eos_token_id],
                     tenancy=Tenancy(limiter))
    client = TestClient(app)
    body = {"model": "m", "max_tokens": 4, "stream": False}
    body.update({"/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi",
                 "max_output_tokens": 16, "store": False}}.get(path, {"messages": USER}))
    if path == "/v1/responses":
        del body["max_tokens"]
    for _ in range(3):
        r = client.post(path, json=body)
        assert r.status_code == 429, r.text
        assert FULL in r.text and "rate limit of" not in r.text
    assert limiter._requests[None].level == 1.0


def test_requests_reach_the_engine_under_their_tenant(tokenizer, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-a alice 3\nsk-b bob\n")
    fake = FakeEngineClient(tokenizer, tokenizer.eos_token_id)
    app = create_app(fake, tokenizer, "m", 2048, [tokenizer.eos_token_id], tenancy=Tenancy())
    install_guard(app, KeyRing.from_config("sk-op", str(keys)), max_body_bytes=0)
    client = TestClient(app)
    for key in ("sk-a", "sk-b", "sk-op"):
        r = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"model": "m", "prompt": "hi", "max_tokens": 2, "n": 2})
        assert r.status_code == 200, r.text
    assert fake.tenants == ["alice", "alice", "bob", "bob", None, None]  # each choice too


def test_key_file_weights(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("k1 alice 2.5\nk2 alice\nk3 bob\nk4\n")
    ring = KeyRing.from_config("op", str(path))
    assert ring.weights() == {"alice": 2.5}  # both of alice's keys; bob and the rest 1
    assert ring.match(b"Bearer k2").weight == 2.5
    for bad in ("k1 alice 0", "k1 alice -1", "k1 alice x", "k1 alice inf"):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match="not a positive number"):
            KeyRing.from_config(None, str(path))
    path.write_text("k1 alice 2\nk2 alice 3\n")
    with pytest.raises(ValueError, match="weight 2 on an earlier line"):
        KeyRing.from_config(None, str(path))


class _Stepped:
    """An engine whose events go out one by one, each when the test sets its gate."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts
        self.gates = [anyio.Event() for _ in counts]

    async def generate(self, rid, input_ids, sampling, cache_namespace=None, tenant=None):
        for i, count in enumerate(self.counts):
            await self.gates[i].wait()
            last = i == len(self.counts) - 1
            yield TokenEvent([7] * count, [0.0] * count, "length" if last else None)

    async def abort(self, rid) -> None:
        pass


def test_generated_tokens_are_charged_as_they_stream(tokenizer) -> None:
    now = [0.0]
    limiter = RateLimiter(tokens_per_s=10, clock=lambda: now[0])
    tenancy = Tenancy(limiter)
    engine = _Stepped([3, 4, 5])

    def job() -> Job:
        return Job("r", [1, 2], SamplingParams(), [], ResponseFormatter("r", 0, "m", False, False),
                   Usage(2))

    scope = {TENANT_SCOPE_KEY: "alice"}
    streaming = tenancy.apply(scope, job(), None)  # 2 prompt tokens taken: 8 left
    assert streaming.tenant == "alice" and streaming.on_done is None

    def level() -> float:
        return limiter._tokens["alice"].level

    async def main() -> list[float]:
        seen = []
        pieces = stream_text(engine, tokenizer, streaming)
        for gate in engine.gates:
            gate.set()
            await pieces.__anext__()
            seen.append(level())
        await pieces.aclose()
        return seen

    # Charged per event while the answer streams: 8 - 3, - 4 (in debt), - 5.
    assert anyio.run(main) == [5.0, 1.0, -4.0]
    # In debt before the first request ended: the tenant's next request waits it off.
    with pytest.raises(APIError, match="10 tokens/s"):
        tenancy.apply(scope, job(), None)
    assert tenancy.apply({TENANT_SCOPE_KEY: "bob"}, job(), None).tenant == "bob"
