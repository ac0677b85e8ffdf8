"""HTTP-level protection, as plain ASGI middleware (streaming responses pass through untouched):

- an optional API key: every path but ``/health`` needs ``Authorization: Bearer <key>``, or gets
  401 with an OpenAI-style error body (compared in constant time);
- a request body limit: a larger body gets 413 before the app reads it (``Content-Length`` is
  checked first; a chunked body is counted as it arrives).
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})


async def _error(send: Send, status: int, message: str, code: str, headers=()) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Args: ``api_key`` (None: no key needed); ``max_body_bytes`` (0: no limit)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                msg = ("missing API key: send 'Authorization: Bearer <key>'" if not given
                       else "incorrect API key")
                return await _error(send, 401, msg, "invalid_api_key",
                                    [(b"www-authenticate", b"Bearer")])
        if not self.max_body_bytes:
            return await self.app(scope, receive, send)
        limit_msg = f"request body exceeds the limit of {self.max_body_bytes} bytes"
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _error(send, 413, limit_msg, "request_too_large")
        # Read the body here (bounded), then replay it to the app.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks = None
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return await _error(send, 413, limit_msg, "request_too_large")
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed and chunks is not None:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def install_guard(app, api_key: str | None, max_body_bytes: int) -> None:
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
