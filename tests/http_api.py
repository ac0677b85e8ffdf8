"""What the HTTP API tests on the fake engine share (tests/server, with the fixtures in
tests/server/conftest.py): the served model's name and context, a chat prompt, the two paths,
a patient timeout, and SSE parsing."""

from __future__ import annotations

from splitserve.server.sse import iter_events

MODEL = "smol-test"
CONTEXT_LEN = 256
USER = [{"role": "user", "content": "Say hi"}]
C, CH = "/v1/completions", "/v1/chat/completions"
# How long a test waits for something the server must do (start, abort a request): only a
# failing test waits this long, so it is generous, for a busy machine.
WAIT_S = 30.0


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
