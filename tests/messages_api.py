"""What the Messages API tests share: Anthropic's SSE parsed (each event named by its data's
``type``), a streamed answer reassembled into its message, and the error-shape check."""

from __future__ import annotations

import json
from typing import Any

from splitserve.server.messages_api.blocks import gather_blocks


def anthropic_events(text: str) -> list[dict[str, Any]]:
    """The data objects of an Anthropic event stream; every event has one ``event:`` line
    naming its data's ``type`` and one ``data:`` line."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith(
            "data: "), block
        data = json.loads(lines[1].removeprefix("data: "))
        assert data["type"] == lines[0].removeprefix("event: "), block
        events.append(data)
    return events


def reassembled(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a client builds from a complete stream: ``message_start``'s message with
    the blocks of the content events and ``message_delta``'s stop reason and usage."""
    message = dict(events[0]["message"])
    message["content"] = gather_blocks(
        [e for e in events if e["type"].startswith("content_block")])
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    message.update(delta["delta"])
    message["usage"] = delta["usage"]
    return message


def check_anthropic_error(status: int, text: str) -> dict[str, Any]:
    """The error object of an Anthropic error body (asserting the shape); returns ``error``."""
    body = json.loads(text)
    assert set(body) == {"type", "error"} and body["type"] == "error", text
    assert set(body["error"]) == {"type", "message"}, text
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], text
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             403: "permission_error", 405: "invalid_request_error", 413: "request_too_large",
             415: "invalid_request_error", 429: "rate_limit_error",
             503: "overloaded_error"}
    assert body["error"]["type"] == kinds.get(status, "api_error"), (status, text)
    return body["error"]
