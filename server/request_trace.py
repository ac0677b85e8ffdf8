"""The router's spans of one traced HTTP request, and the middleware that starts them.

:class:`ObserveMiddleware` stamps every HTTP request's arrival (``state["arrival"]``, wall
seconds: the start of its timing breakdown, ``observe.timing``) and whether the client asked
for the breakdown (``x-splitserve-timing`` header). With tracing on, a ``POST /v1/...``
request gets a root span (``POST /v1/chat/completions``, kind SERVER) whose parent is the
caller's ``traceparent`` header when it sent one (sampled as that header says; else by
``--trace-sample-ratio``), its trace id in the ``x-trace-id`` response header, and a
:class:`RequestTrace` in ``state["trace"]`` for the routes. The root span ends when the answer
has been sent, or when the client left first (``splitserve.aborted``).

Under the root: ``receive`` (arrival to the body checked), ``template``, ``tokenize``, one
``attempt`` span per attempt on the workers (a re-run after a lost worker is a ``retry`` span;
the attempt it replaces ends with outcome ``retried``), each with its ``route`` span (workers
picked, tasks sent); the workers' spans are children of their attempt's span, through the
``traceparent`` of its ``GenerateTask``. ``tool_parse`` marks tool-call parsing.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

TIMING_HEADER = b"x-splitserve-timing"
TRACE_ID_HEADER = b"x-trace-id"


class Attempt:
    """The span of one attempt of one request on the workers."""

    __slots__ = ("export", "span", "started", "traceparent")

    def __init__(self, export: Any, span: Any) -> None:
        self.export = export
        self.span = span
        self.started = time.time()
        self.traceparent = export.traceparent(span)

    def routed(self, workers: list[str]) -> None:
        """Its tasks were sent to ``workers``: the ``route`` span ends."""
        self.export.span("route", self.span, self.started, time.time(),
                         {"splitserve.workers": ",".join(workers)})

    def end(self, outcome: str, error: str | None = None) -> None:
        """The attempt ended (``outcome``: the request's state, lower case)."""
        self.span.set_attribute("splitserve.outcome", outcome)
        self.export.end(self.span, time.time(), error)


class RequestTrace:
    """The root span of one traced request and its children (see the module docstring)."""

    __slots__ = ("export", "root")

    def __init__(self, export: Any, root: Any) -> None:
        self.export = export
        self.root = root

    def stage(self, name: str, start: float, end: float, **attributes: Any) -> None:
        """A child span of the root from ``start`` to ``end`` (wall seconds)."""
        self.export.span(name, self.root, start, end, attributes or None)

    def attempt(self, rid: str, number: int, error: str | None = None) -> Attempt:
        """The span of attempt ``number`` (0: the first, ``attempt``; later ones ``retry``,
        with the previous attempt's ``error``) of wire rid ``rid``."""
        attrs: dict[str, Any] = {"splitserve.rid": rid, "splitserve.attempt": number}
        if error:
            attrs["splitserve.retry_reason"] = error
        name = "attempt" if number == 0 else "retry"
        return Attempt(self.export, self.export.start(name, self.root, time.time(), "client",
                                                      attrs))


class ObserveMiddleware:
    """Arrival stamps, the timing opt-in and (``export`` not None) root spans; see the module
    docstring. ``export``: ``observe.otel.TraceExport`` or None (tracing off)."""

    def __init__(self, app: ASGIApp, export: Any = None) -> None:
        self.app = app
        self.export = export

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        arrival = time.time()
        headers = dict(scope.get("headers") or [])
        state = scope.setdefault("state", {})
        state["arrival"] = arrival
        state["wants_timing"] = headers.get(TIMING_HEADER, b"0") not in (b"0", b"", b"false")
        export = self.export
        if export is None or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        parent = headers.get(b"traceparent", b"").decode("latin-1") or None
        root = export.start(f"POST {scope['path']}", parent, arrival, "server",
                            {"http.request.method": "POST", "url.path": scope["path"]})
        if not export.is_recording(root):
            root.end()
            return await self.app(scope, receive, send)
        state["trace"] = RequestTrace(export, root)
        trace_id = export.trace_id(root).encode()
        outcome = {"status": 0, "done": False}

        async def observed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                outcome["status"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (TRACE_ID_HEADER, trace_id)]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                outcome["done"] = True
            await send(message)

        error = None
        try:
            await self.app(scope, receive, observed_send)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            status = outcome["status"]
            root.set_attribute("http.response.status_code", status)
            if not outcome["done"]:
                root.set_attribute("splitserve.aborted", True)  # the client left first
            failed = error or (f"HTTP {status}" if status >= 500 else None)
            export.end(root, time.time(), failed)
