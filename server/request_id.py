"""``X-Request-Id``: a client's id for its request, used as the request's ``rid`` (so the
server's and the workers' logs carry it) and echoed in the response's ``X-Request-Id`` header,
as vLLM and most proxies do.

Plain ASGI middleware (streamed responses pass through untouched). The id is kept in the ASGI
scope's ``state`` (``request.state.request_id``; None when the client sent none). An id that is
not printable ASCII or longer than :data:`MAX_REQUEST_ID_LEN` is a 400 naming the header.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
MAX_REQUEST_ID_LEN = 128


def valid_request_id(value: bytes) -> bool:
    """Printable ASCII without spaces (it becomes part of log lines and ZeroMQ message ids)."""
    return 0 < len(value) <= MAX_REQUEST_ID_LEN and all(0x21 <= b <= 0x7E for b in value)


class RequestIdMiddleware:
    """Reads and checks ``X-Request-Id``, stores it for the routes, echoes it on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(HEADER)
        scope.setdefault("state", {})["request_id"] = None
        if given is None:
            return await self.app(scope, receive, send)
        if not valid_request_id(given):
            return await _bad_id(send)
        scope["state"]["request_id"] = given.decode()

        async def echo(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, given)]}
            await send(message)

        await self.app(scope, receive, echo)


async def _bad_id(send: Send) -> None:
    body = json.dumps({"error": {
        "message": f"X-Request-Id: must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII characters "
                   "without spaces",
        "type": "invalid_request_error", "param": "X-Request-Id", "code": None}}).encode()
    await send({"type": "http.response.start", "status": 400, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
