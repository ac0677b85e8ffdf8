"""The API server process: tokenizer + OpenAI-compatible app + ZeroMQ client to the workers."""

from __future__ import annotations

import contextlib
import gc
import logging
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from splitserve.config import ServeConfig
from splitserve.server.chat_template import ChatRenderer
from splitserve.server.guard import install_guard
from splitserve.server.membership import install_membership
from splitserve.server.metrics import ServerMetrics, install_metrics
from splitserve.server.models import ServedModels
from splitserve.server.rate_limit import RateLimiter
from splitserve.server.routes import create_app
from splitserve.server.tenancy import KeyRing, Tenancy
from splitserve.server.worker_client import ZmqEngineClient


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
    client = ZmqEngineClient(
        s.inbox, prefill=prefill, decode=decode, colocated=colocated, routing=s.routing,
        dead_after_s=s.dead_after_s,
        max_inflight_per_worker=s.max_inflight_per_worker, curve=curve, metrics=metrics,
    )
    metrics.attach(client.pool)
    keys = KeyRing.from_config(config.security.api_key, config.security.api_key_file)
    tenancy = Tenancy(RateLimiter(s.rate_limit_rps, s.rate_limit_tps))
    template = Path(s.chat_template).read_text() if s.chat_template else None
    chat = ChatRenderer(tokenizer, template, s.tool_call_parser, family_format)
    e = config.engine
    models = ServedModels(Path(model_path).name, e.lora_enabled, e.lora_dir, e.lora_modules,
                          e.pinned_loras)
    app = create_app(client, tokenizer, Path(model_path).name, context_len, eos_ids,
                     tenancy=tenancy, chat=chat, metrics=metrics, models=models)
    install_membership(app, client.pool)
    install_metrics(app, metrics)
    install_guard(app, keys, s.max_body_bytes)
    install_cors(app, s.allowed_origins)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await client.start()
        # Start-up state (tokenizer, app, templates) outlives every request: frozen, a full
        # collection no longer walks it while tokens stream.
        gc.collect()
        gc.freeze()
        yield
        await client.close()

    app.router.lifespan_context = lifespan
    serve_app(app, s.host, s.port, config.log_level)


def install_cors(app: FastAPI, allowed_origins: list[str]) -> None:
    """Let browsers on ``allowed_origins`` call the API (none: no CORS headers at all).

    Installed after the guard, so it is the outermost layer: a browser's preflight ``OPTIONS``
    carries no API key and must be answered before the key is checked (the real request that
    follows still needs it)."""
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])


def create_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for ``app`` on the uvloop event loop (``server.run()`` blocks)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, loop="uvloop", timeout_graceful_shutdown=5
    )
    return uvicorn.Server(config)


def serve_app(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve ``app`` until interrupted (uvicorn, uvloop)."""
    create_server(app, host, port, log_level).run()
