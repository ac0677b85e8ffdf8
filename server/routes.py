"""The OpenAI-compatible HTTP API: its routes, over a :class:`BaseEngineClient`.

One request's path through the server's files: parse the body (``server.protocol``; bad input ->
400 via ``server.errors``), build its :class:`Job` (``server.job_builder``: prompt ids, chat
template, ``SamplingParams``, checked against the context length), generate its text
(``server.generation``: the engine stream, detokenization, stop strings, abort), and answer as
JSON or SSE (``server.responses``) while watching for a client that leaves (``server.disconnect``).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from splitserve.server.constraint_check import checked_pieces, partial_header
from splitserve.server.disconnect import client_gone, unless_disconnected
from splitserve.server.engine_client import BaseEngineClient
from splitserve.server.errors import APIError, from_validation_errors, install_error_handlers
from splitserve.server.generation import stream_text
from splitserve.server.job import Job
from splitserve.server.job_builder import JobBuilder
from splitserve.server.protocol import BaseGenerateRequest, ChatCompletionRequest, CompletionRequest
from splitserve.server.responses import full_response, streaming_response


def create_app(
    client: BaseEngineClient,
    tokenizer: Any,
    model_name: str,
    context_len: int,
    eos_token_ids: list[int],
    metrics: Any | None = None,
) -> FastAPI:
    """The OpenAI-compatible API for one model served through ``client``.

    Args:
        client: where requests go (the ZeroMQ worker client, or a fake in tests).
        tokenizer: the model's Hugging Face tokenizer (with a chat template for chat).
        model_name: the ``model`` clients must send (``"default"`` is accepted too).
        context_len: prompt + generated tokens may not exceed this.
        eos_token_ids: ids that end generation unless the request sets ``ignore_eos``.
        metrics: the ``server.metrics.ServerMetrics`` whose violation counter the json_schema
            safety net increments (None: not counted).
    """
    jobs = JobBuilder(tokenizer, model_name, context_len, eos_token_ids)
    created = int(time.time())
    app = FastAPI(title="splitserve", version="0.1.0")
    install_error_handlers(app)

    violations = None if metrics is None else metrics.constraint_violations

    def pieces(job: Job) -> Any:
        return checked_pieces(job, stream_text(client, tokenizer, job), violations)

    async def respond(request: Request, job: Job, stream: bool | None) -> Response:
        # stream_text runs inside the watched work: a disconnect cancels it there, and its
        # finally aborts the request on the workers.
        headers = partial_header(job)
        if stream:
            sse = await unless_disconnected(
                request, lambda: streaming_response(job, pieces(job))
            )
            if sse is not None:
                sse.headers.update(headers)
            return client_gone() if sse is None else sse
        body = await unless_disconnected(
            request, lambda: full_response(job, pieces(job), tokenizer)
        )
        return client_gone() if body is None else JSONResponse(body, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await _parse(request, CompletionRequest)
        return await respond(request, jobs.completion_job(req), req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        return await respond(request, jobs.chat_job(req), req.stream)

    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "splitserve",
            "max_model_len": context_len,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        if not jobs.serves(model):
            raise APIError(f"model '{model}' not found", param="model", status_code=404)
        return model_card()

    @app.get("/chat_template")
    async def chat_template() -> dict[str, Any]:
        # For clients that render role-structured prompts themselves (splitserve.lang) and send
        # them to /v1/completions with add_special_tokens false.
        return {
            "chat_template": getattr(tokenizer, "chat_template", None),
            "bos_token": getattr(tokenizer, "bos_token", None),
            "eos_token": getattr(tokenizer, "eos_token", None),
        }

    @app.get("/health")
    async def health() -> Response:
        if client.is_ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "starting"}, status_code=503)

    @app.get("/workers")
    async def workers() -> list[dict]:
        return await client.worker_stats()

    @app.post("/flush_cache")
    async def flush_cache() -> list[dict]:
        """Drop every prefix-cache entry no running request pins; answers after the workers
        did, with their stats (for benchmarks and tests)."""
        return await client.flush_cache()

    return app


async def _parse(request: Request, model_cls: type[BaseGenerateRequest]) -> Any:
    """Validate the raw body ourselves: malformed JSON and bad fields both become 400."""
    body = await request.body()
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None

