"""What a web page may make a browser send here: nothing but what the operator allowed.

A browser attaches no API key of ours, but it will send a "simple" cross-origin request (a
``POST`` with ``Content-Type: text/plain``, a form post, a ``no-cors`` fetch) without asking
first, so any page its user opens could flush the cache, drain a worker or spend the model
(OWASP's CSRF guidance: check ``Origin``, refuse bodies that are not JSON). Two rules, as plain
ASGI middleware installed on the whole app (``server.routes.create_app``), so that every route,
including those added later, is under them:

- **Origin**: a request whose ``Origin`` header is present and not allowed gets 403
  (``origin_not_allowed``). Allowed: the ``--allowed-origins`` list (``*``: any), and the
  server's own origin (a page it serves calling it back), which is the request's ``Host`` with
  its scheme, provided that host is an IP literal or ``localhost``: a DNS name pointing here
  (DNS rebinding: ``evil.example`` resolved to 127.0.0.1 makes the attacker's page "same
  origin") must be listed. A ``POST`` with no ``Origin`` but ``Sec-Fetch-Site: cross-site`` or
  ``same-site`` (a browser that left ``Origin`` out) is refused the same way. Clients that are
  not browsers (curl, the OpenAI SDK) send neither header and are not affected.
- **JSON only**: every ``POST`` with a body (or a content type) must say ``Content-Type:
  application/json`` (parameters such as ``charset`` allowed), else 415
  (``unsupported_media_type``), before its body is read; a bodiless ``POST`` naming no type
  (``.../cancel`` from curl) carries nothing to parse. A page
  can send ``application/json`` cross-origin only after a CORS preflight, which this server
  answers only for ``--allowed-origins``.

The operator routes' own rule (the operator key, or a loopback client when no key is set) is
``server.tenancy.require_operator``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.server.asgi_errors import error_response

JSON_MEDIA_TYPE = "application/json"
CROSS_SITE = (b"cross-site", b"same-site")  # Sec-Fetch-Site values of another origin's page


class BrowserGuardMiddleware:
    """Refuse requests from origins not allowed and ``POST`` bodies that are not JSON.

    Args:
        app: the ASGI app it guards.
        allowed_origins: origins (``scheme://host[:port]``) whose pages may call the API, or
            ``["*"]`` for any; empty (the default): only the server's own pages.
        on_refused: called with ``"origin"`` or ``"content_type"`` for each refusal (the
            ``splitserve_requests_refused_total`` counter), or None.
    """

    def __init__(self, app: ASGIApp, allowed_origins: Iterable[str] = (),
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.on_refused = on_refused
        origins = [o.rstrip("/").lower() for o in allowed_origins]
        self.any_origin = "*" in origins
        self.allowed = frozenset(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin")
        is_post = scope["method"] == "POST"
        if origin is not None and not self.origin_allowed(origin.decode("latin-1"), scope,
                                                          headers.get(b"host")):
            self._count("origin")
            return await error_response(
                send, scope["path"], 403,
                f"requests from origin {origin.decode('latin-1')!r} are not allowed; "
                "start the server with --allowed-origins naming it to let its pages call the API",
                "origin_not_allowed", type_="permission_error")
        if origin is None and is_post and headers.get(b"sec-fetch-site") in CROSS_SITE:
            self._count("origin")
            return await error_response(
                send, scope["path"], 403, "cross-site requests are not allowed (Sec-Fetch-Site: "
                f"{headers[b'sec-fetch-site'].decode('latin-1')}, no Origin)",
                "origin_not_allowed", type_="permission_error")
        if is_post and not is_json(headers.get(b"content-type")) and not is_bodiless(headers):
            given = headers.get(b"content-type", b"none").decode("latin-1")
            self._count("content_type")
            return await error_response(
                send, scope["path"], 415,
                f"POST bodies must be JSON: send 'Content-Type: {JSON_MEDIA_TYPE}' "
                f"(got {given!r})", "unsupported_media_type")
        await self.app(scope, receive, send)

    def _count(self, reason: str) -> None:
        if self.on_refused is not None:
            self.on_refused(reason)

    def origin_allowed(self, origin: str, scope: Scope, host: bytes | None) -> bool:
        """Whether a page of ``origin`` may call: listed, or this server's own origin (see the
        module's docstring for why only an IP literal or ``localhost`` counts as its own)."""
        origin = origin.rstrip("/").lower()
        if self.any_origin or origin in self.allowed:
            return True
        if host is None:
            return False
        host_text = host.decode("latin-1").lower()
        own = f"{scope.get('scheme', 'http')}://{host_text}"
        return origin == own and is_literal_host(host_text)


def is_json(content_type: bytes | None) -> bool:
    """Whether a ``Content-Type`` header names ``application/json`` (any parameters)."""
    if content_type is None:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == JSON_MEDIA_TYPE.encode()


def is_bodiless(headers: dict[bytes, bytes]) -> bool:
    """Whether a request has no body and names no content type (``POST .../cancel`` from curl):
    nothing to parse, and a browser sending it cross-origin still sends ``Origin``."""
    return (b"content-type" not in headers and b"transfer-encoding" not in headers
            and headers.get(b"content-length", b"0") == b"0")


def is_literal_host(host: str) -> bool:
    """Whether ``host`` (``name[:port]``, ``[v6]:port``) names this machine without DNS: an IP
    literal or ``localhost``."""
    if host.startswith("["):
        name = host[1:].split("]", 1)[0]
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback_client(scope: Scope) -> bool:
    """Whether the request came from this machine's loopback (127.0.0.0/8, ::1, or an
    IPv4-mapped loopback). A client that is not an IP address (a test transport) is not."""
    client = scope.get("client")
    if not client:
        return False
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback
