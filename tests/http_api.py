"""What the HTTP API tests on the fake engine share (tests/server, with the fixtures in
tests/server/conftest.py): the served model's name and context, a chat prompt, the two paths,
a patient timeout, SSE parsing, an app served for real on a free port, and an app whose first
token is held (a slow prefill)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from splitserve.server.fake_client import FakeEngineClient
from splitserve.server.main import create_server
from splitserve.server.routes import create_app
from splitserve.server.sse import iter_events

MODEL = "smol-test"
CONTEXT_LEN = 256
USER = [{"role": "user", "content": "Say hi"}]
C, CH = "/v1/completions", "/v1/chat/completions"
# How long a test waits for something the server must do (start, abort a request): only a
# failing test waits this long, so it is generous, for a busy machine.
WAIT_S = 30.0


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    """``app`` on a live uvicorn server in a thread; yields its base URL, stops it after."""
    server = create_server(app, "127.0.0.1", 0, log_level="warning")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here so the port is known and free of races
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def sse_events(text: str) -> list[dict | str]:
    """Parse an SSE body into JSON objects, with "[DONE]" kept as a string; every event must be a
    single ``data: `` line."""
    for block in text.split("\n\n"):
        assert not block.strip() or (block.startswith("data: ") and "\n" not in block), block
    return list(iter_events(text.splitlines()))


def streamed_text(events: list[dict | str], is_chat: bool) -> str:
    out = ""
    for ev in events:
        if isinstance(ev, dict) and ev.get("choices"):
            choice = ev["choices"][0]
            out += (choice["delta"].get("content") or "") if is_chat else choice["text"]
    return out


@contextlib.contextmanager
def held_first_app(tokenizer: Any, reply: str) -> Iterator[tuple[FakeEngineClient, Any]]:
    """An app on the fake engine whose first event waits for ``fake.hold_first`` (a prefill
    that takes minutes, without the minutes); yields ``(fake, app)`` and releases the event
    at exit, so nothing stays blocked after a failing test."""
    fake = FakeEngineClient(tokenizer, eos_token_id=tokenizer.eos_token_id, reply=reply)
    fake.hold_first = threading.Event()
    try:
        yield fake, create_app(fake, tokenizer, MODEL, 2048, [tokenizer.eos_token_id])
    finally:
        fake.hold_first.set()


def sse_blocks(lines: Iterable[str]) -> Iterator[tuple[str | None, Any]]:
    """A live stream's SSE blocks as they are read: ``("comment", line)`` for a comment, else
    ``(event name or None, data as JSON)``."""
    name = None
    for line in lines:
        if line.startswith(":"):
            yield "comment", line
        elif line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            yield name, json.loads(line[len("data: "):])
