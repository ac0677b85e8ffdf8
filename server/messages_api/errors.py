"""Anthropic's error body, ``{"type": "error", "error": {"type", "message"}}``, for every error
on the Messages routes: validation, refused fields, 401/404/413/429/503 and our own failures.

The rest of the API answers OpenAI's shape (``server.errors``); :func:`is_messages_path` tells
the two apart by path, so the app's error handlers and the guard (``server.guard``) pick the
shape a request's client expects. Types and statuses follow Anthropic's errors reference
(https://docs.anthropic.com/en/api/errors).
"""

from __future__ import annotations

from typing import Any

from splitserve.server.errors import APIError

MESSAGES_PATH = "/v1/messages"

# HTTP status -> Anthropic's error type. 503 (no healthy worker, overload) is Anthropic's
# "overloaded_error" (it sends that as 529); the status stays ours, with Retry-After.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is ``/v1/messages`` or under it (``/v1/messages/count_tokens``)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status_code: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status: ``invalid_request_error`` for the other
    4xx, ``api_error`` for the other 5xx."""
    if status_code in _TYPES:
        return _TYPES[status_code]
    return "invalid_request_error" if 400 <= status_code < 500 else "api_error"


def error_body(status_code: int, message: str) -> dict[str, Any]:
    """The body of an error with ``status_code`` saying ``message``."""
    return {"type": "error", "error": {"type": error_type(status_code), "message": message}}


def api_error_body(err: APIError) -> dict[str, Any]:
    """The Anthropic body of ``err`` (its status and message; ``param`` is in the message)."""
    return error_body(err.status_code, err.message)
