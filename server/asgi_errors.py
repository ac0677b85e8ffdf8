"""Error answers sent by ASGI middleware (``server.guard``, ``server.browser_guard``) before any
route runs, in the shape the path's API uses: Anthropic's ``{"type": "error", "error": {...}}``
on the Messages paths (``server.messages_api.errors``), OpenAI's ``{"error": {"message",
"type", "param", "code"}}`` everywhere else (``server.errors``)."""

from __future__ import annotations

import json

from starlette.types import Send

from splitserve.server.messages_api.errors import error_body, is_messages_path


async def error_response(send: Send, path: str, status: int, message: str, code: str,
                         headers=(), type_: str = "invalid_request_error") -> None:
    """Answer ``status`` with ``message`` in the error shape of ``path``'s API.

    Args:
        send: the ASGI send callable of the request being refused.
        path: the request's path (``scope["path"]``); it picks the body's shape.
        status: the HTTP status (4xx).
        message: what was wrong, naming the header or field.
        code: OpenAI's ``error.code`` (Anthropic's shape has none).
        headers: extra ``(name, value)`` byte pairs (``Retry-After``, ``WWW-Authenticate``).
        type_: OpenAI's ``error.type`` (Anthropic's is derived from ``status``).
    """
    shape = (error_body(status, message) if is_messages_path(path) else
             {"error": {"message": message, "type": type_, "param": None, "code": code}})
    body = json.dumps(shape).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": body})
