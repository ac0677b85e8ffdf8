"""API key and body-size limit (``server.guard``), on the fake engine: 401 and 413 come with an
OpenAI-style error body; ``/health`` stays open; a 503 carries ``Retry-After``."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.guard import install_guard
from splitserve.server.metrics import ServerMetrics, install_metrics
from splitserve.server.routes import create_app

KEY = "sk-test-123"
BODY = {"model": "default", "prompt": "hi", "max_tokens": 4}


@pytest.fixture
def fake(tokenizer) -> FakeEngineClient:
    return FakeEngineClient(tokenizer, tokenizer.eos_token_id)


@pytest.fixture
def client(fake, tokenizer) -> TestClient:
    app = create_app(fake, tokenizer, "m", 2048, [tokenizer.eos_token_id])
    install_metrics(app, ServerMetrics())
    install_guard(app, KEY, max_body_bytes=1000)
    return TestClient(app)


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers", [{}, auth("wrong"), {"Authorization": KEY}])
def test_missing_or_wrong_key_is_401(client, headers) -> None:
    for method, path in [("post", "/v1/completions"), ("get", "/v1/models"),
                         ("get", "/workers"), ("get", "/metrics")]:
        r = getattr(client, method)(path, headers=headers, **({"json": BODY} if method == "post" else {}))
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"


def test_right_key_is_served_and_health_is_open(client) -> None:
    assert client.post("/v1/completions", json=BODY, headers=auth()).status_code == 200
    assert client.get("/health").status_code == 200
    r = client.get("/metrics", headers=auth())
    assert r.status_code == 200 and "splitserve_time_to_first_token_seconds" in r.text


def test_body_over_limit_is_413(client) -> None:
    big = {**BODY, "prompt": "x" * 2000}
    r = client.post("/v1/completions", json=big, headers=auth())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(5):
            yield b"x" * 300

    r = client.post("/v1/completions", content=chunks(), headers=auth())
    assert r.status_code == 413
    assert client.post("/v1/completions", json=BODY, headers=auth()).status_code == 200


def test_503_has_retry_after(client, fake) -> None:
    fake.error, fake.error_after_events = ("server overloaded", 503), 0
    r = client.post("/v1/completions", json=BODY, headers=auth())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
