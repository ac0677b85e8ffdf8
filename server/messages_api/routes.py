"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

One request's path: the body's fields against the tables (``messages_api.fields``), parsed
(``messages_api.protocol``), translated into the chat request (``messages_api.translate``),
built into its job by the chat path's ``JobBuilder`` (all of it off the event loop, through the
chat path's ``server.offload``, so a huge body never stalls other streams) and put under its
tenant (``server.tenancy``), run through the same ``stream_text`` as chat (``pieces``), and answered
as a message or an event stream (``messages_api.answer``). Every error on these paths has
Anthropic's shape (``messages_api.errors``, applied by the app's error handlers).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from splitserve.server.constraint_check import partial_header
from splitserve.server.disconnect import client_gone, unless_disconnected
from splitserve.server.errors import APIError, from_validation_errors
from splitserve.server.generation import Piece
from splitserve.server.job import Job
from splitserve.server.job_builder import JobBuilder
from splitserve.server.messages_api.answer import Answer, full_message, streaming_message
from splitserve.server.messages_api.errors import MESSAGES_PATH
from splitserve.server.messages_api.fields import COUNT_TOKENS_FIELDS, check_messages_fields
from splitserve.server.messages_api.protocol import CountTokensRequest, MessagesRequest
from splitserve.server.messages_api.translate import as_messages_error, translate
from splitserve.server.offload import Offload
from splitserve.server.tenancy import Tenancy

logger = logging.getLogger(__name__)


def install_messages_routes(app: FastAPI, jobs: JobBuilder, tenancy: Tenancy,
                            pieces: Callable[[Job], AsyncIterator[Piece]],
                            offload: Offload) -> None:
    """Add the Messages routes to ``app``.

    Args:
        jobs: builds each request's job, as for chat.
        tenancy: cache namespace and rate limits of each job.
        pieces: runs a job (``server.generation.stream_text`` under the json_schema check).
        offload: where parsing, translating, the chat template and tokenizing run (the chat
            routes' own threads; 503 when its queue is full).
    """

    @app.post(MESSAGES_PATH)
    async def messages(request: Request) -> Response:
        req: MessagesRequest = await offload.run(
            parse_body, await request.body(), MessagesRequest, None)
        job, answer = await offload.run(_job, jobs, req, request.state.request_id)
        job = tenancy.apply(request.scope, job, None)
        logger.info("request %s: %s, %d prompt tokens, X-Request-Id %s", job.rid,
                    request.url.path, len(job.input_ids), request.state.request_id)
        if req.stream:
            sse = await unless_disconnected(
                request, lambda: streaming_message(job, answer, pieces(job)))
            if sse is None:
                return client_gone()
            # The worker's report when the first piece came within FIRST_PIECE_WAIT_S; a
            # stream that started without it says what the plan predicts.
            sse.headers.update(partial_header(job))
            return sse
        body = await unless_disconnected(request, lambda: full_message(job, answer, pieces(job)))
        return client_gone() if body is None else JSONResponse(body, headers=partial_header(job))

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        req: CountTokensRequest = await offload.run(
            parse_body, await request.body(), CountTokensRequest, COUNT_TOKENS_FIELDS)
        return {"input_tokens": await offload.run(_count_tokens, jobs, req)}


def _count_tokens(jobs: JobBuilder, req: CountTokensRequest) -> int:
    """The prompt length of ``req`` as the chat template renders it (blocking: run it through
    ``server.offload``).

    Raises:
        APIError: another model (404), or as ``translate`` and ``JobBuilder.prompt_ids``.
    """
    _check_model(jobs, req.model)
    translated = translate(req, jobs.chat.reasoning is not None)
    try:
        ids = jobs.prompt_ids(translated.chat, continuation=translated.prefill)
    except APIError as err:
        raise as_messages_error(err) from None
    return len(ids)


def _job(jobs: JobBuilder, req: MessagesRequest, request_id: str | None) -> tuple[Job, Answer]:
    """The job of ``req``: the chat path's, with the stop sequences and ``max_tokens`` (capped
    by the context window's room) applied (blocking: run it through ``server.offload``).

    Raises:
        APIError: another model (404), or as ``translate`` and ``JobBuilder.chat_job``.
    """
    _check_model(jobs, req.model)
    translated = translate(req, jobs.chat.reasoning is not None)
    try:
        job = jobs.chat_job(translated.chat, request_id, continuation=translated.prefill)
    except APIError as err:
        raise as_messages_error(err) from None
    job.stop = translated.stop
    room = job.sampling.max_new_tokens  # no max_tokens in the chat request: all the room
    job.sampling = msgspec.structs.replace(job.sampling,
                                           max_new_tokens=max(1, min(req.max_tokens, room)))
    suffix = job.rid.removeprefix("chatcmpl-") if request_id is None else job.rid
    return job, Answer(f"msg_{suffix}", req.model, req.max_tokens)


def _check_model(jobs: JobBuilder, model: str) -> None:
    if not jobs.serves(model):
        raise APIError(f"model: {model!r} is not served here; use {jobs.model_name!r}",
                       param="model", status_code=404)


def parse_body(body: bytes, model_cls: type[BaseModel], fields: Any = None) -> Any:
    """The body checked against the field tables (``fields``: another table than the create
    request's), then parsed; any bad input is a 400 (blocking: run it through
    ``server.offload``)."""
    try:
        decoded = from_json(body)
    except ValueError:
        decoded = None  # not JSON: model_validate_json says so below
    if fields is None:
        check_messages_fields(decoded)
    else:
        check_messages_fields(decoded, fields)
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(), decoded) from None
