"""The Responses API's routes: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items`` and ``POST /v1/responses/{id}/cancel``.

A create request is checked (``field_check``, then ``protocol``), its conversation assembled
(the stored response it continues, then its own input, ``item_reference`` s resolved from the
store), translated into the chat request (``translate``) and built into the chat path's job by
the same ``JobBuilder`` (parsing, translating, the chat template and tokenizing off the event
loop, through the chat path's ``server.offload``), under the same tenancy (cache namespace, rate limits); its pieces come
from the same ``stream_text`` the chat routes use (``pieces``). Every stored response is
looked up by the request's tenant: another tenant's id is a 404, as an unknown one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from pydantic_core import from_json

from splitserve.server.constraint_check import partial_header
from splitserve.server.disconnect import SSEResponse, client_gone, unless_disconnected
from splitserve.server.errors import APIError, from_validation_errors
from splitserve.server.generation import Piece
from splitserve.server.job import Job
from splitserve.server.job_builder import JobBuilder
from splitserve.server.offload import Offload
from splitserve.server.responses_api import items
from splitserve.server.responses_api.background import BackgroundRuns
from splitserve.server.responses_api.envelope import TERMINAL, Envelope
from splitserve.server.responses_api.field_check import check_request
from splitserve.server.responses_api.protocol import (
    FunctionCallItem,
    ItemReference,
    MessageItem,
    ResponsesRequest,
)
from splitserve.server.responses_api.run import ResponseRun, sse_events
from splitserve.server.responses_api.store import AsyncResponseStore, StoredResponse
from splitserve.server.responses_api.translate import as_responses_error, chat_request
from splitserve.server.tenancy import Tenancy, request_tenant
from splitserve.server.token_text import TokenSpeller

logger = logging.getLogger(__name__)

MAX_LIST = 100  # items per input_items page, as OpenAI


def install_responses_routes(app: FastAPI, jobs: JobBuilder, tenancy: Tenancy,
                             store: AsyncResponseStore, speller: TokenSpeller,
                             pieces: Callable[[Job], AsyncIterator[Piece]],
                             offload: Offload) -> BackgroundRuns:
    """Add the Responses API to ``app``.

    Args:
        jobs: builds each request's job, as for chat.
        tenancy: cache namespace and rate limits, as for chat.
        store: where responses are kept.
        speller: spells tokens for logprobs.
        pieces: a job's pieces (the chat routes' own: ``stream_text`` under the json_schema
            safety net).
        offload: where parsing, translating, the chat template and tokenizing run (the chat
            routes' own threads; 503 when its queue is full).

    Returns:
        The app's background responses (for tests and shutdown).
    """
    background = BackgroundRuns(store)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req: ResponsesRequest = await offload.run(parse_body, await request.body())
        tenant = request_tenant(request.scope) or ""
        if req.background and not req.stores:
            raise APIError("background: a background response must be stored; remove "
                           "store: false", param="background")
        if req.background and req.stream:
            raise APIError("stream: streaming a background response is not supported here; "
                           "poll GET /v1/responses/{id} instead", param="stream",
                           code="unsupported_parameter")
        context, found = await _stored_context(req, tenant, store)
        conversation, job = await offload.run(_prepare, jobs, req, context, found,
                                              request.state.request_id)
        envelope = Envelope.new(items.new_id("resp"), req)
        if req.background:
            background.check_room()
        job = tenancy.apply(request.scope, job, None)
        logger.info("response %s: request %s, %d prompt tokens, X-Request-Id %s",
                    envelope.response_id, job.rid, len(job.input_ids), request.state.request_id)

        async def keep(body: dict[str, Any]) -> None:
            await store.put(tenant, body, conversation)

        run = ResponseRun(envelope, job, speller, req.wants_logprobs,
                          on_done=keep if req.stores else None)
        if req.background:
            queued = run.body("queued")
            await store.put(tenant, queued, conversation)
            background.start(tenant, run, pieces(job), conversation)
            return JSONResponse(queued)
        if req.stream:
            return await _streamed(request, run, pieces(job))
        body = await unless_disconnected(request, lambda: run.complete(pieces(job)))
        # The workers' report of the grammar they compiled (recorded with the first token).
        return client_gone() if body is None else JSONResponse(body, headers=partial_header(job))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> dict[str, Any]:
        if request.query_params.get("stream", "false").lower() == "true":
            raise APIError("stream: replaying a response's events is not supported here; GET "
                           "it without stream", param="stream", code="unsupported_parameter")
        tenant = request_tenant(request.scope) or ""
        running = background.running(tenant, response_id)
        if running is not None:
            return running.body()
        return (await _stored(store, tenant, response_id)).body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
        tenant = request_tenant(request.scope) or ""
        await background.cancel(tenant, response_id)
        if not await store.delete(tenant, response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> dict[str, Any]:
        tenant = request_tenant(request.scope) or ""
        await background.cancel(tenant, response_id)
        body = (await _stored(store, tenant, response_id)).body
        if not body.get("background"):
            raise APIError(f"response {response_id} was not created in the background; only "
                           "background responses can be cancelled", param="response_id")
        return body

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(request: Request, response_id: str) -> dict[str, Any]:
        tenant = request_tenant(request.scope) or ""
        limit, order, after = _list_params(request)
        stored = await _stored(store, tenant, response_id)
        return item_page(stored.input_items, limit, order, after)

    return background


def parse_body(body: bytes) -> ResponsesRequest:
    """The body checked against the field tables, then parsed; any bad input is a 400
    (blocking: run it through ``server.offload``)."""
    try:
        decoded = from_json(body)
    except ValueError:
        decoded = None  # not JSON: model_validate_json says so below
    check_request(decoded)
    try:
        return ResponsesRequest.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(), decoded) from None


async def _stored_context(req: ResponsesRequest, tenant: str, store: AsyncResponseStore
                          ) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """What the store holds for ``req``: the previous response's conversation, and each
    ``item_reference`` of its input resolved (by its index in the input).

    Raises:
        APIError: an unknown (or unfinished) ``previous_response_id``, an unknown
            ``item_reference``.
    """
    context: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = await store.get(tenant, req.previous_response_id)
        if prev is None:
            raise APIError(f"previous_response_id: no stored response {req.previous_response_id!r}"
                           " (never stored, deleted, expired, or another API key's)",
                           param="previous_response_id", code="previous_response_not_found")
        if prev.body["status"] not in TERMINAL:
            raise APIError(f"previous_response_id: {req.previous_response_id} is still "
                           f"{prev.body['status']}; wait for it to finish",
                           param="previous_response_id")
        context = prev.conversation
    found: dict[int, dict[str, Any]] = {}
    for i, item in enumerate([] if isinstance(req.input, str) else req.input):
        if isinstance(item, ItemReference):
            stored = await store.item(tenant, item.id)
            if stored is None:
                raise APIError(f"input[{i}].id: no stored item {item.id!r}",
                               param=f"input[{i}].id", code="item_not_found")
            found[i] = stored
    return context, found


def _prepare(jobs: JobBuilder, req: ResponsesRequest, context: list[dict[str, Any]],
             found: dict[int, dict[str, Any]], request_id: str | None
             ) -> tuple[list[dict[str, Any]], Job]:
    """The conversation the answer continues (``context``, then ``req``'s input in its stored
    shape, references taken from ``found``) and its chat job (blocking: run it through
    ``server.offload``).

    Raises:
        APIError: a call's arguments that are not a JSON object, or as ``chat_request`` and
            ``JobBuilder.chat_job``, in Responses' terms.
    """
    given = ([MessageItem(role="user", content=req.input)] if isinstance(req.input, str)
             else req.input)
    own = []
    for i, item in enumerate(given):
        if i in found:
            own.append(found[i])
        else:
            if isinstance(item, FunctionCallItem):
                _check_arguments(item.arguments, f"input[{i}].arguments")
            own.append(items.input_item(item))
    conversation = context + own
    try:
        job = jobs.chat_job(chat_request(req, conversation, jobs.chat.reasoning is not None),
                            request_id)
    except APIError as err:
        raise as_responses_error(err) from None
    return conversation, job


def _check_arguments(arguments: str, param: str) -> None:
    """Raises: APIError when a call's ``arguments`` are not a JSON object (chat templates
    write them as one)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError as exc:
        raise APIError(f"{param}: not valid JSON ({exc})", param=param) from None
    if not isinstance(value, dict):
        raise APIError(f"{param}: must be a JSON object", param=param)


async def _streamed(request: Request, run: ResponseRun, pieces: AsyncIterator[Piece]
                    ) -> Response:
    """The SSE answer, started once its first event is in (an error before that is plain
    JSON with its status)."""
    events = sse_events(run, pieces)

    async def first() -> str:
        try:
            return await anext(events)
        except BaseException:
            await events.aclose()  # type: ignore[attr-defined]
            raise

    head = await unless_disconnected(request, first)
    if head is None:
        return client_gone()

    async def body() -> AsyncIterator[str]:
        yield head
        async for event in events:
            yield event

    sse = SSEResponse(body())
    # The worker's report when the first piece came before the first event; a stream that
    # started without it (after FIRST_PIECE_WAIT_S) says what the plan predicts.
    sse.headers.update(partial_header(run.job))
    return sse


async def _stored(store: AsyncResponseStore, tenant: str, response_id: str) -> StoredResponse:
    stored = await store.get(tenant, response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> APIError:
    return APIError(f"no stored response {response_id!r} (never stored, deleted, expired, or "
                    "another API key's)", param="response_id", status_code=404,
                    type="invalid_request_error", code="response_not_found")


def _list_params(request: Request) -> tuple[int, str, str | None]:
    """``limit`` (1-100, default 20), ``order`` (``asc``/``desc``, default ``desc``) and
    ``after`` of an ``input_items`` request.

    Raises:
        APIError: a value outside those.
    """
    q = request.query_params
    raw = q.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST:
        raise APIError(f"limit: must be an integer from 1 to {MAX_LIST}, not {raw!r}",
                       param="limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(f"order: must be 'asc' or 'desc', not {order!r}", param="order")
    return int(raw), order, q.get("after")


def item_page(all_items: list[dict[str, Any]], limit: int, order: str,
              after: str | None) -> dict[str, Any]:
    """One page of an item list in OpenAI's list shape (``after``: the id the page starts
    after, in ``order``).

    Raises:
        APIError: ``after`` names no item of the list.
    """
    ordered = all_items if order == "asc" else all_items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise APIError(f"after: no item {after!r} in this response's input", param="after")
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(ordered)}
