"""Fixtures for the HTTP API tests on the deterministic fake engine: the engine, a test client
on the app, and the app served for real on a free port (for the openai client and for clients
that go away). A test module that needs another engine or app defines its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.routes import create_app
from tests.http_api import CONTEXT_LEN, MODEL, served


@pytest.fixture
def fake(tokenizer) -> FakeEngineClient:
    return FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id)


@pytest.fixture
def client(fake, tokenizer) -> TestClient:
    app = create_app(fake, tokenizer, MODEL, CONTEXT_LEN, [tokenizer.eos_token_id])
    return TestClient(app)


@pytest.fixture
def live_server(fake, tokenizer) -> Iterator[str]:
    app = create_app(fake, tokenizer, MODEL, CONTEXT_LEN, [tokenizer.eos_token_id])
    with served(app) as url:
        yield url
