"""A local OTLP/HTTP trace receiver for tests and docs: it accepts ``POST /v1/traces``
(protobuf, as the OpenTelemetry SDK's OTLP/HTTP exporter sends it), decodes each export with
``opentelemetry-proto`` and keeps the spans, flat, for assertions; :func:`waterfall_html`
renders one trace as a waterfall (docs/observability.md's picture)."""

from __future__ import annotations

import gzip
import html
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    name: str
    service: str
    instance: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    kind: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status: int = 0
    status_message: str = ""

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def decode_spans(body: bytes) -> list[Span]:
    """The spans of one OTLP/HTTP protobuf export body."""
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        res = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(
                    s.name, res.get("service.name", ""), res.get("service.instance.id", ""),
                    s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                    s.start_time_unix_nano, s.end_time_unix_nano, s.kind,
                    {a.key: _value(a.value) for a in s.attributes}, s.status.code,
                    s.status.message))
    return out


class OTLPReceiver:
    """Listens on ``127.0.0.1:<port>``; :attr:`endpoint` is what ``--otlp-traces-endpoint``
    takes. Use as a context manager."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                spans = decode_spans(body)
                with receiver.cond:
                    receiver.spans += spans
                    receiver.cond.notify_all()
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def trace(self, trace_id: str) -> list[Span]:
        with self.cond:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, predicate: Callable[[list[Span]], Any], timeout_s: float = 30) -> Any:
        """Wait until ``predicate(spans so far)`` is truthy (checked on every export); returns
        its value. Raises: AssertionError after ``timeout_s``."""
        with self.cond:
            value = self.cond.wait_for(lambda: predicate(list(self.spans)), timeout_s)
        assert value, f"the spans asked for did not arrive within {timeout_s:g} s"
        return value


def waterfall_html(spans: list[Span], title: str) -> str:
    """One trace as an HTML waterfall: a row per span in tree order (indented under its
    parent), its bar placed on the trace's time line, its service and duration."""
    by_parent: dict[str, list[Span]] = {}
    ids = {s.span_id for s in spans}
    for s in spans:
        by_parent.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    t0 = min(s.start_ns for s in spans)
    t1 = max(s.end_ns for s in spans)
    scale = 100.0 / max(1, t1 - t0)
    colors = {"splitserve-api": "#2f6fdf", "splitserve-prefill": "#1f9d55",
              "splitserve-decode": "#e08a2c", "splitserve-colocated": "#7a5bd0"}
    rows = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(by_parent.get(parent, []), key=lambda x: (x.start_ns, x.name)):
            left, width = (s.start_ns - t0) * scale, max(0.15, (s.end_ns - s.start_ns) * scale)
            extra = ""
            if "splitserve.steps" in s.attributes:
                extra = f" · {s.attributes['splitserve.steps']} steps"
            if "splitserve.tokens" in s.attributes:
                extra = f" · {s.attributes['splitserve.tokens']} tokens"
            rows.append(
                f'<tr><td style="padding-left:{8 + depth * 14}px">{html.escape(s.name)}</td>'
                f'<td class="svc">{html.escape(s.service.removeprefix("splitserve-"))}</td>'
                f'<td class="bar"><div style="left:{left:.3f}%;width:{width:.3f}%;'
                f'background:{colors.get(s.service, "#888")}"></div></td>'
                f'<td class="ms">{s.duration_s * 1e3:.1f} ms{html.escape(extra)}</td></tr>')
            walk(s.span_id, depth + 1)

    walk("", 0)
    return f"""<!doctype html><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font:13px system-ui,sans-serif;margin:14px;color:#1d2330}}
table{{border-collapse:collapse;width:1000px}}td{{padding:2px 6px;border-bottom:1px solid #eceef2;
white-space:nowrap}}td.svc{{color:#6b7385}}td.bar{{width:560px;position:relative}}
td.bar div{{position:absolute;top:4px;height:12px;border-radius:2px}}td.ms{{text-align:right;
font-variant-numeric:tabular-nums}}h3{{margin:0 0 8px}}</style>
<h3>{html.escape(title)}</h3><p style="color:#6b7385;margin:0 0 8px">{len(spans)} spans, 
{(t1 - t0) / 1e6:.1f} ms, trace {spans[0].trace_id}</p><table>{"".join(rows)}</table>"""
