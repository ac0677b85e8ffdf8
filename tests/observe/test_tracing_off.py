"""Tracing off is free: neither the OpenTelemetry SDK nor its exporter is imported, and no
exporter is made, in the API server (its app, its middleware) or in a worker (its tracer).
(FastAPI itself imports the OpenTelemetry *API* package when it is installed; that is no
tracer, no exporter and no thread.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from splitserve.config import TracingConfig
from splitserve.observe.otel import create_trace_export


def test_no_export_without_an_endpoint() -> None:
    assert create_trace_export(TracingConfig(), "splitserve-api", "x") is None


def test_a_server_and_a_worker_with_tracing_off_import_no_opentelemetry(model_path) -> None:
    code = textwrap.dedent("""
        import sys
        from splitserve.config import ServeConfig, WorkerConfig
        from splitserve.config.registry import WORKER_ROLE
        from splitserve.observe.otel import create_trace_export
        from splitserve.server.fake_client import FakeEngineClient
        from splitserve.server.main import run_api_server  # the whole server's imports
        from splitserve.server.routes import create_app
        from splitserve.worker.build import create_worker_tracer
        from splitserve.worker.loop import Worker  # the whole worker's imports

        config = ServeConfig()
        export = create_trace_export(config.tracing, "splitserve-api", "x")
        assert export is None
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(sys.argv[1])
        fake = FakeEngineClient(tok, tok.eos_token_id)
        app = create_app(fake, tok, "m", 64, [0], trace_export=export)
        for role in ("prefill", "decode", "colocated"):
            worker = WorkerConfig(role=role, worker_id="w", addr="tcp://127.0.0.1:1")
            assert create_worker_tracer(worker, WORKER_ROLE.load(role)) is None
        print(sorted(m for m in sys.modules
                     if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(model_path)], capture_output=True,
                         text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
