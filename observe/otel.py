"""One process's OpenTelemetry trace export over OTLP/HTTP (the SDK's ``TracerProvider``, a
``BatchSpanProcessor`` and the OTLP/HTTP protobuf exporter), and the W3C ``traceparent`` glue
our ZeroMQ messages carry (https://www.w3.org/TR/trace-context/).

Imported only when tracing is on (:func:`create_trace_export` returns None without importing
any OpenTelemetry module otherwise), so a server or worker with tracing off pays nothing.
The provider is this object's, not OpenTelemetry's process-wide global, so several of them
(tests, benchmarks) live in one process.

Spans are made with explicit start and end times from the stamps each process keeps per
request (``observe.timing``, ``worker.tracing``): the hot path records numbers, and spans are
built off it, once per stage.
"""

from __future__ import annotations

from typing import Any

from splitserve.config.schema import TracingConfig

EXPORT_DELAY_MS = 500  # the batch processor's export interval (the SDK's default is 5 s)


def create_trace_export(config: TracingConfig, service: str, instance: str,
                        follow_parent_only: bool = False) -> TraceExport | None:
    """The export of this process's spans, or None when tracing is off (nothing imported).

    Args:
        config: the cluster's tracing settings.
        service: ``service.name`` of the spans (``splitserve-api``, ``splitserve-prefill``...).
        instance: ``service.instance.id`` (the worker id, or the API server's address).
        follow_parent_only: trace only what a sampled parent asks for (workers: the router
            decides); else a request without a parent is sampled by ``config.sample_ratio``.

    Raises:
        ImportError: tracing is on and the OpenTelemetry SDK or its OTLP/HTTP exporter is not
            installed (``pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http``).
    """
    if not config.enabled:
        return None
    return TraceExport(config, service, instance, follow_parent_only)


class TraceExport:
    """Makes spans and exports them in the background (see the module docstring)."""

    def __init__(self, config: TracingConfig, service: str, instance: str,
                 follow_parent_only: bool = False) -> None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        root = ALWAYS_OFF if follow_parent_only else TraceIdRatioBased(config.sample_ratio)
        resource = Resource.create({"service.name": service, "service.instance.id": instance})
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(root))
        self.exporter = OTLPSpanExporter(endpoint=config.otlp_traces_endpoint)
        self.provider.add_span_processor(
            BatchSpanProcessor(self.exporter, schedule_delay_millis=EXPORT_DELAY_MS))
        self.tracer = self.provider.get_tracer("splitserve")
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = {"server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT,
                       "internal": trace.SpanKind.INTERNAL}
        self._error = trace.Status(trace.StatusCode.ERROR)

    def context(self, traceparent: str | None) -> Any:
        """The OpenTelemetry context whose parent is ``traceparent`` (None or malformed: an
        empty context, so a span started in it is a root)."""
        if not traceparent:
            return None
        return self._propagator.extract({"traceparent": traceparent})

    def start(self, name: str, parent: Any, start_s: float, kind: str = "internal",
              attributes: dict[str, Any] | None = None) -> Any:
        """A span started at ``start_s`` (wall-clock seconds). ``parent``: a span, a context
        (:meth:`context`), a ``traceparent`` string, or None (a root span)."""
        if isinstance(parent, str):
            parent = self.context(parent)
        elif parent is not None and not isinstance(parent, dict):
            parent = self._trace.set_span_in_context(parent)
        return self.tracer.start_span(name, context=parent, kind=self._kinds[kind],
                                      attributes=attributes, start_time=_ns(start_s))

    def span(self, name: str, parent: Any, start_s: float, end_s: float,
             attributes: dict[str, Any] | None = None, kind: str = "internal") -> Any:
        """A span from ``start_s`` to ``end_s`` under ``parent``, ended at once."""
        span = self.start(name, parent, start_s, kind, attributes)
        span.end(end_time=_ns(max(end_s, start_s)))
        return span

    def end(self, span: Any, end_s: float, error: str | None = None) -> None:
        """End ``span`` at ``end_s``; ``error``: mark it failed, with this description."""
        if error is not None:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error))
        span.end(end_time=_ns(end_s))

    @staticmethod
    def is_recording(span: Any) -> bool:
        """Whether ``span`` was sampled (its children and its workers' spans are exported)."""
        return span.is_recording()

    def traceparent(self, span: Any) -> str:
        """``span``'s W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``)."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier["traceparent"]

    @staticmethod
    def trace_id(span: Any) -> str:
        """``span``'s trace id, 32 lowercase hex digits."""
        return format(span.get_span_context().trace_id, "032x")

    def flush(self, timeout_ms: int = 5000) -> None:
        """Export every ended span now."""
        self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Export what is left and stop the export thread."""
        self.provider.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
