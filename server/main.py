"""The API server process: tokenizer + OpenAI-compatible app + ZeroMQ client to the workers."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from splitserve.server.app import create_app, serve_app
from splitserve.server.guard import DEFAULT_MAX_BODY_BYTES, install_guard
from splitserve.server.membership import install_membership
from splitserve.server.metrics import ServerMetrics, install_metrics
from splitserve.server.worker_client import ZmqEngineClient


def read_model_limits(model_path: str) -> tuple[int, list[int]]:
    """``(context_len, eos_token_ids)`` from the model folder's config files, without torch."""
    from splitserve.engine.model_config import ModelConfig

    cfg = ModelConfig.from_dir(model_path)
    return cfg.context_len, list(cfg.eos_token_ids)


def run_api_server(
    model_path: str,
    host: str,
    port: int,
    inbox: str,
    prefill: list[str],
    decode: list[str],
    colocated: list[str],
    log_level: str = "info",
    routing: str = "cache_aware",
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    dead_after_s: float = 5.0,
    max_inflight_per_worker: int = 256,
    curve_keys: str | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM. The served model name is the model folder's name.
    ``routing``: prefill-worker policy (``server.routing.ROUTING_POLICIES``). Workers may also
    join later (``POST /workers/register``)."""
    from transformers import AutoTokenizer

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s api %(levelname)s %(message)s")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    context_len, eos_ids = read_model_limits(model_path)
    curve = None
    if curve_keys:
        from splitserve.security import CurveKeys

        curve = CurveKeys.load(curve_keys)
    metrics = ServerMetrics()
    client = ZmqEngineClient(
        inbox, prefill=prefill, decode=decode, colocated=colocated, routing=routing,
        dead_after_s=dead_after_s,
        max_inflight_per_worker=max_inflight_per_worker, curve=curve, metrics=metrics,
    )
    metrics.attach(client)
    app = create_app(client, tokenizer, Path(model_path).name, context_len, eos_ids)
    install_membership(app, client)
    install_metrics(app, metrics)
    install_guard(app, api_key, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await client.start()
        yield
        await client.close()

    app.router.lifespan_context = lifespan
    serve_app(app, host, port, log_level)



