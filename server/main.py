"""The API server process: tokenizer + OpenAI-compatible app + ZeroMQ client to the workers."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from splitserve.config import ServeConfig
from splitserve.observe.otel import create_trace_export
from splitserve.server.chat_template import ChatRenderer
from splitserve.server.cluster_view import ClusterView, install_cluster_view
from splitserve.server.guard import install_guard
from splitserve.server.membership import install_membership
from splitserve.server.metrics import ServerMetrics, install_metrics
from splitserve.server.models import ServedModels
from splitserve.server.offload import Offload
from splitserve.server.rate_limit import RateLimiter
from splitserve.server.responses_api.store import AsyncResponseStore, ResponseStore
from splitserve.server.routes import create_app
from splitserve.server.tenancy import KeyRing, Tenancy
from splitserve.server.ui import install_ui
from splitserve.server.worker_client import ZmqEngineClient

logger = logging.getLogger(__name__)


def read_model_facts(model_path: str) -> tuple[int, list[int], str | None]:
    """``(context_len, eos_token_ids, tool_call_format)`` from the model folder's config
    files; the last is the ``engine.model.registry`` format of its architecture (None: the
    family declares none).

    Raises:
        FileNotFoundError: no ``config.json``. ValueError: an unsupported architecture.
    """
    from splitserve.engine.model.config import ModelConfig
    from splitserve.engine.model.registry import get_architecture

    cfg = ModelConfig.from_dir(model_path)
    family_format = get_architecture(cfg.architecture).tool_call_format
    return cfg.context_len, list(cfg.eos_token_ids), family_format


def run_api_server(
    config: ServeConfig, prefill: list[str], decode: list[str], colocated: list[str]
) -> None:
    """Serve until SIGINT/SIGTERM on ``config.server`` (its ``inbox`` set) for the model
    ``config.engine.model``, whose folder name is the served model name. ``prefill``,
    ``decode``, ``colocated``: the inboxes of the workers started with it; others may join
    later (``POST /workers/register``)."""
    from transformers import AutoTokenizer

    s, model_path = config.server, config.engine.model
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s api %(levelname)s %(message)s")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    context_len, eos_ids, family_format = read_model_facts(model_path)
    curve = None
    if config.security.curve_keys:
        from splitserve.ipc.security import CurveKeys

        curve = CurveKeys.load(config.security.curve_keys)
    metrics = ServerMetrics()
    assert s.inbox is not None
    keys = KeyRing.from_config(config.security.api_key, config.security.api_key_file)
    client = ZmqEngineClient(
        s.inbox, prefill=prefill, decode=decode, colocated=colocated, routing=s.routing,
        dead_after_s=s.dead_after_s,
        max_inflight_per_worker=s.max_inflight_per_worker, curve=curve, metrics=metrics,
        max_queued_per_worker=s.max_queued_per_worker, fair_queueing=s.fair_queueing,
        max_queue_wait_s=s.max_queue_wait_s,
        tenant_weights=keys.weights() if keys is not None else None,
    )
    metrics.attach(client.pool)
    metrics.attach_gate(client.gate)
    warning = exposure_warning(s.host, keys)
    if warning:
        logger.warning(warning)
    tenancy = Tenancy(RateLimiter(s.rate_limit_rps, s.rate_limit_tps))
    template = Path(s.chat_template).read_text() if s.chat_template else None
    chat = ChatRenderer(tokenizer, template, s.tool_call_parser, family_format,
                        s.reasoning_parser, s.reasoning_budget)
    store = ResponseStore(s.responses_store_path, s.responses_store_max_mb * 2**20,
                          s.responses_store_max_age_s)
    export = create_trace_export(config.tracing, "splitserve-api", s.url)
    model_name = Path(model_path).name
    e = config.engine
    models = ServedModels(model_name, e.lora_enabled, e.lora_dir, e.lora_modules,
                          e.pinned_loras)
    app = create_app(client, tokenizer, model_name, context_len, eos_ids,
                     tenancy=tenancy, chat=chat, metrics=metrics, models=models,
                     responses_store=AsyncResponseStore(store), trace_export=export,
                     allowed_origins=s.allowed_origins,
                     offload=Offload(s.prepare_threads, 128 * s.prepare_threads))
    install_membership(app, client.pool)
    install_metrics(app, metrics)
    view = ClusterView(client.pool, metrics, model_name)
    install_cluster_view(app, view)
    if s.ui:
        install_ui(app)
    install_guard(app, keys, s.max_body_bytes)
    install_cors(app, s.allowed_origins)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await client.start()
        sampler = asyncio.ensure_future(view.run())
        # Start-up state (tokenizer, app, templates) outlives every request: frozen, a full
        # collection no longer walks it while tokens stream.
        gc.collect()
        gc.freeze()
        yield
        sampler.cancel()
        await client.close()
        store.close()
        if export is not None:
            export.shutdown()

    app.router.lifespan_context = lifespan
    serve_app(app, s.host, s.port, config.log_level)


def exposure_warning(host: str, keys: KeyRing | None) -> str | None:
    """The start-up warning for an API that listens beyond loopback with no key (None when
    it does not): anyone who can reach the port may use the model, and the operator routes
    refuse them only because they are not on loopback."""
    if keys is not None or _is_loopback_host(host):
        return None
    return (f"the API listens on {host or 'every address'} with no API key: anyone who can "
            "reach this port can generate, and read /metrics and /workers (the operator "
            "routes answer loopback clients only). Set SPLITSERVE_API_KEY (or --api-key) "
            "for a server others can reach; see docs/operations.md#security-and-tenancy")


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "0.0.0.0" parses; a host name other than localhost may resolve anywhere


def install_cors(app: FastAPI, allowed_origins: list[str]) -> None:
    """Let browsers on ``allowed_origins`` call the API (none: no CORS headers at all).

    Installed after the guard, so it is the outermost layer: a browser's preflight ``OPTIONS``
    carries no API key and must be answered before the key is checked (the real request that
    follows still needs it)."""
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=[
                               "X-Request-Id", "X-Trace-Id", "X-Splitserve-Timing"])


def create_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for ``app`` on the uvloop event loop (``server.run()`` blocks)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, loop="uvloop", timeout_graceful_shutdown=5
    )
    return uvicorn.Server(config)


def serve_app(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve ``app`` until interrupted (uvicorn, uvloop)."""
    create_server(app, host, port, log_level).run()
