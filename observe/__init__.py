"""Observability shared by every process: the OpenTelemetry export (``otel``, imported only when
tracing is on) and the per-request timing breakdown (``timing``, no dependencies).
docs/observability.md says what each stage, span and metric means."""
