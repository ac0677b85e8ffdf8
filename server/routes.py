"""The OpenAI-compatible HTTP API (and Anthropic's Messages API, ``server.messages_api``): its
routes, over a :class:`BaseEngineClient`.

One request's path through the server's files: parse the body (``server.protocol``; bad input ->
400 via ``server.errors``), build its :class:`Job` (``server.job_builder``: prompt ids, chat
template, ``SamplingParams``, checked against the context length; ``n`` > 1 forks one job per
choice: ``server.choices``), generate its text
(``server.generation``: the engine stream, detokenization, stop strings, abort), and answer as
JSON or SSE (``server.responses``) while watching for a client that leaves (``server.disconnect``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from pydantic_core import from_json

from splitserve.observe.timing import RequestTiming, server_timing_header
from splitserve.server.browser_guard import BrowserGuardMiddleware
from splitserve.server.cache_header import cache_header
from splitserve.server.chat_template import ChatRenderer
from splitserve.server.choices import fork_choices, summed_usage
from splitserve.server.constraint_check import checked_pieces, partial_header
from splitserve.server.disconnect import client_gone, unless_disconnected
from splitserve.server.engine_client import BaseEngineClient
from splitserve.server.errors import (
    APIError,
    from_validation_errors,
    install_error_handlers,
    use_error_body,
)
from splitserve.server.field_check import check_fields
from splitserve.server.fields import Endpoint
from splitserve.server.generation import stream_text
from splitserve.server.job import Job
from splitserve.server.job_builder import JobBuilder
from splitserve.server.lora_routes import install_lora_routes
from splitserve.server.messages_api.errors import api_error_body, is_messages_path
from splitserve.server.messages_api.routes import install_messages_routes
from splitserve.server.models import ServedModels
from splitserve.server.offload import Offload
from splitserve.server.protocol import BaseGenerateRequest, ChatCompletionRequest, CompletionRequest
from splitserve.server.request_id import RequestIdMiddleware
from splitserve.server.request_trace import ObserveMiddleware
from splitserve.server.responses import full_response, merge_choices, streaming_response
from splitserve.server.responses_api.routes import install_responses_routes
from splitserve.server.responses_api.store import AsyncResponseStore, memory_store
from splitserve.server.tenancy import Tenancy, require_operator
from splitserve.server.token_text import TokenSpeller
from splitserve.server.tokenize import install_tokenize_routes, server_version

logger = logging.getLogger(__name__)


def create_app(
    client: BaseEngineClient,
    tokenizer: Any,
    model_name: str,
    context_len: int,
    eos_token_ids: list[int],
    chat: ChatRenderer | None = None,
    tenancy: Tenancy | None = None,
    metrics: Any | None = None,
    models: ServedModels | None = None,
    responses_store: AsyncResponseStore | None = None,
    trace_export: Any | None = None,
    allowed_origins: Sequence[str] = (),
    offload: Offload | None = None,
) -> FastAPI:
    """The OpenAI-compatible API for one model served through ``client``.

    Args:
        client: where requests go (the ZeroMQ worker client, or a fake in tests).
        tokenizer: the model's Hugging Face tokenizer (with a chat template for chat).
        model_name: the ``model`` clients must send (``"default"`` is accepted too).
        context_len: prompt + generated tokens may not exceed this.
        eos_token_ids: ids that end generation unless the request sets ``ignore_eos``.
        tenancy: cache namespaces (API key, ``cache_salt``) and rate limits (default: no
            limits; the namespace still follows the salt and the guard's tenant).
        chat: renders chat prompts and knows the tool-call format (default: the tokenizer's
            template, ``--tool-call-parser auto``).
        metrics: the ``server.metrics.ServerMetrics`` whose violation counter the json_schema
            safety net increments (None: not counted).
        models: the names ``model`` may take: the base model's and its LoRA adapters'
            (``server.models``; default: ``model_name`` only, no adapters).
        responses_store: where ``/v1/responses`` keeps responses (default: in memory, for
            this app's life; ``server.responses_api.store``).
        trace_export: the ``observe.otel.TraceExport`` request spans go to (None: tracing
            off); every request is timed either way (``server.request_trace``).
        allowed_origins: browser origins whose pages may call the API besides the server's
            own (``server.browser_guard``, installed on the whole app: every route, including
            those added to the app later, refuses other origins and ``POST`` bodies that are
            not JSON).
        offload: where a request's CPU work runs, off the event loop: parsing, the chat
            template, tokenizing, constraint planning, validating outputs (default: 2
            threads, ``server.offload``).
    """
    chat = chat or ChatRenderer(tokenizer)
    offload = offload or Offload()
    models = models or ServedModels(model_name)
    jobs = JobBuilder(tokenizer, model_name, context_len, eos_token_ids, chat, models)
    tenancy = tenancy or Tenancy()
    speller = TokenSpeller(tokenizer)
    created = int(time.time())
    app = FastAPI(title="splitserve", version=server_version())
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(ObserveMiddleware, export=trace_export)
    app.add_middleware(BrowserGuardMiddleware, allowed_origins=allowed_origins,
                       on_refused=None if metrics is None else metrics.count_refused)
    install_tokenize_routes(app, jobs, tokenizer, context_len, offload)
    install_lora_routes(app, models, client)

    violations = None if metrics is None else metrics.constraint_violations

    def pieces(job: Job) -> Any:
        return checked_pieces(job, stream_text(client, tokenizer, job), violations, offload)

    # Anthropic's Messages API: the same jobs and pieces, its own shapes (errors included).
    install_messages_routes(app, jobs, tenancy, pieces, offload)
    use_error_body(app, is_messages_path, api_error_body)

    async def respond(request: Request, batch: list[Job], stream: bool | None) -> Response:
        """Answer with the jobs of one request: one, several prompts' (not streamed), or the
        ``n`` choices of one prompt (``server.choices``), lead first."""
        for job in batch:
            logger.info("request %s: %s, %d prompt tokens, X-Request-Id %s", job.rid,
                        request.url.path, len(job.input_ids), request.state.request_id)
        # stream_text runs inside the watched work: a disconnect cancels it there, and its
        # finally aborts the request on the workers.
        if stream:
            sse = await unless_disconnected(
                request,
                lambda: streaming_response(batch, [pieces(job) for job in batch], speller),
            )
            if sse is not None:  # the lead's first piece is in: its prompt was matched, and
                # its worker reported the grammar it compiled (every choice has the same one)
                sse.headers.update({**partial_header(batch[0]),
                                    **cache_header(summed_usage(batch))})
            return client_gone() if sse is None else sse
        body = await unless_disconnected(request, lambda: _run_all(batch))
        if body is None:
            return client_gone()
        headers = partial_header(batch[0])  # the lead's workers' report
        timing = batch[0].timing
        if timing is not None and timing.wanted:  # the lead choice's breakdown
            end = time.time()
            headers = {**headers, "x-splitserve-timing": server_timing_header(timing.stages(end))}
            body["splitserve_timing"] = timing.summary(end)
        return JSONResponse(body, headers={**headers, **cache_header(summed_usage(batch))})

    async def _run_all(batch: list[Job]) -> dict[str, Any]:
        if len(batch) == 1:
            return await full_response(batch[0], pieces(batch[0]), speller)
        bodies: list[dict[str, Any]] = [{} for _ in batch]

        async def run(i: int) -> None:
            job = batch[i]
            bodies[i] = await full_response(job, pieces(job), speller)

        try:
            # A job that fails cancels the others (their stream_text aborts them on the workers).
            async with anyio.create_task_group() as group:
                for i in range(len(batch)):
                    group.start_soon(run, i)
        except BaseExceptionGroup as group_error:
            raise _first_api_error(group_error) from None
        return merge_choices(batch, bodies)

    install_responses_routes(app, jobs, tenancy, responses_store or memory_store(), speller,
                             pieces, offload)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await offload.run(
            parse_body, await request.body(), CompletionRequest, "completions")
        timing = request_timing(request)
        built = await offload.run(jobs.completion_jobs, req, request.state.request_id, timing)
        prompts = [tenancy.apply(request.scope, job, req.cache_salt) for job in built]
        batch = [c for p, job in enumerate(prompts) for c in fork_choices(job, req.n or 1, p)]
        return await respond(request, observed(request, batch, timing), req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await offload.run(
            parse_body, await request.body(), ChatCompletionRequest, "chat")
        timing = request_timing(request)
        built = await offload.run(jobs.chat_job, req, request.state.request_id, timing)
        job = tenancy.apply(request.scope, built, req.cache_salt)
        return await respond(request, observed(request, fork_choices(job, req.n or 1, 0), timing),
                             req.stream)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """The base model, then its LoRA adapters (each with ``parent`` = the base)."""
        return {"object": "list", "data": models.cards(created, context_len)}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        return models.card(model, created, context_len)

    @app.get("/chat_template")
    async def chat_template() -> dict[str, Any]:
        # For clients that render role-structured prompts themselves (splitserve.lang) and send
        # them to /v1/completions with add_special_tokens false.
        return {
            "chat_template": chat.template,
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
    async def flush_cache(request: Request) -> list[dict]:
        """Drop every prefix-cache entry no running request pins; answers after the workers
        did, with their stats (for benchmarks and tests). The operator's only (every
        tenant's entries go): a tenant's key gets 403 (``server.tenancy.require_operator``)."""
        require_operator(request.scope, "POST /flush_cache")
        return await client.flush_cache()

    return app


def request_timing(request: Request) -> RequestTiming:
    """A fresh timing breakdown for ``request``, from its arrival (``server.request_trace``);
    its body has been read and checked: the trace's ``receive`` span ends now."""
    state = request.scope.get("state") or {}
    now = time.time()
    timing = RequestTiming(state.get("arrival") or now, bool(state.get("wants_timing")))
    trace = state.get("trace")
    if trace is not None:
        trace.stage("receive", timing.arrival, now)
    return timing


def observed(request: Request, batch: list[Job], timing: RequestTiming) -> list[Job]:
    """Give each job of ``batch`` (the choices of one request) its timing (the lead
    ``timing``, the others a fork of it) and the request's trace, whose ``template`` and
    ``tokenize`` spans are made now from ``timing.prepare``. Returns ``batch``."""
    trace = (request.scope.get("state") or {}).get("trace")
    if trace is not None:
        for name, start, end in timing.prepare:
            trace.stage(name, start, end)
    for i, job in enumerate(batch):
        job.timing = timing if i == 0 else timing.fork()
        job.trace = trace
    return batch


def _first_api_error(group: BaseExceptionGroup) -> BaseException:
    """The error to answer with when a job of a batch failed: its APIError if it raised one."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            exc = _first_api_error(exc)
        if isinstance(exc, APIError):
            return exc
    return group.exceptions[0]


def parse_body(body: bytes, model_cls: type[BaseGenerateRequest], endpoint: Endpoint) -> Any:
    """Validate the raw body ourselves: malformed JSON, fields we do not serve (the table of
    ``server.fields``) and bad values all become 400 (blocking: run it through
    ``server.offload``)."""
    try:
        decoded = from_json(body)
    except ValueError:
        decoded = None  # not JSON: model_validate_json says so below
    check_fields(endpoint, decoded)
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(), decoded) from None

