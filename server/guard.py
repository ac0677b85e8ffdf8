"""HTTP-level protection, as plain ASGI middleware (streaming responses pass through untouched):

- optional API keys (a :class:`~splitserve.server.tenancy.KeyRing`): every path but ``/health``
  and the web page's static files (``/``, ``/ui/...``, no data in them) needs
  ``Authorization: Bearer <key>`` with one of them, or the same key in ``x-api-key``
  (Anthropic's header: its clients and Claude Code send that), or gets 401 in the path's
  error shape (compared in constant time); the key's tenant is recorded in the scope
  (``server.tenancy.TENANT_SCOPE_KEY``) for the prefix-cache namespace and rate limits, and that
  a key was checked (``KEYED_SCOPE_KEY``), which the operator routes need;
- a request body limit: a larger body gets 413 before the app reads it (``Content-Length`` is
  checked first; a chunked body is counted as it arrives).

Both errors have OpenAI's body, or Anthropic's on the Messages paths
(``server.messages_api.errors``).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.server.asgi_errors import error_response
from splitserve.server.tenancy import KEYED_SCOPE_KEY, TENANT_SCOPE_KEY, KeyRing

OPEN_PATHS = frozenset({"/health", "/"})
# The web page's static files (server.ui): the page asks for the key and sends it itself.
OPEN_PREFIXES = ("/ui/",)


class GuardMiddleware:
    """Args: ``keys`` (None: no key needed; a ``str``: that one key); ``max_body_bytes`` (0: no
    limit)."""

    def __init__(self, app: ASGIApp, keys: KeyRing | str | None, max_body_bytes: int) -> None:
        self.app = app
        self.keys = KeyRing.from_config(keys, None) if isinstance(keys, str) else keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope["path"]
        if self.keys is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            given = presented_key(headers)
            key = self.keys.match(given)
            if key is None:
                msg = ("missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: "
                       "<key>'" if not given else "incorrect API key")
                return await error_response(send, path, 401, msg, "invalid_api_key",
                                            [(b"www-authenticate", b"Bearer")])
            scope[TENANT_SCOPE_KEY] = key.tenant
            scope[KEYED_SCOPE_KEY] = True
        if not self.max_body_bytes:
            return await self.app(scope, receive, send)
        limit_msg = f"request body exceeds the limit of {self.max_body_bytes} bytes"
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await error_response(send, path, 413, limit_msg, "request_too_large")
        # Read the body here (bounded), then replay it to the app.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks = None
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return await error_response(send, path, 413, limit_msg, "request_too_large")
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


def presented_key(headers: dict[bytes, bytes]) -> bytes:
    """The key a request presents, as ``KeyRing.match`` takes it (``b"Bearer <key>"``): its
    ``Authorization`` header, else its ``x-api-key`` header; ``b""`` for neither."""
    given = headers.get(b"authorization", b"")
    if not given and headers.get(b"x-api-key"):
        given = b"Bearer " + headers[b"x-api-key"]
    return given


def install_guard(app, keys: KeyRing | str | None, max_body_bytes: int) -> None:
    """Guard ``app``: ``keys`` as :class:`GuardMiddleware` takes them."""
    app.add_middleware(GuardMiddleware, keys=keys, max_body_bytes=max_body_bytes)
