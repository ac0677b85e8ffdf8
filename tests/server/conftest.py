"""Fixtures for the HTTP API tests on the deterministic fake engine: the engine, a test client
on the app, and the app served for real on a free port (for the openai client and for clients
that go away). A test module that needs another engine or app defines its own."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.main import create_server
from splitserve.server.routes import create_app
from tests.http_api import CONTEXT_LEN, MODEL, WAIT_S


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
    server = create_server(app, "127.0.0.1", 0, log_level="warning")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here so the port is known and free of races
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()
