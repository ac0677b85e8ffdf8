"""The OpenAI-compatible HTTP API: validate, tokenize, generate through a
:class:`BaseEngineClient`, detokenize, apply stop strings, answer as JSON or SSE.

One request's path: parse the body (``server.protocol``; bad input -> 400 via ``server.errors``),
build its prompt ids and ``SamplingParams`` (checked against the context length), then pull
``TokenEvent`` s from the client through ``stream_text``, which owns the request's life in the
engine: whenever the stream stops early (stop string, client gone) it aborts the request there.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from splitserve.ipc.messages import SamplingParams
from splitserve.server.constraints import constraint_from_request
from splitserve.server.detokenizer import IncrementalDetokenizer
from splitserve.server.engine_client import BaseEngineClient
from splitserve.server.errors import APIError, from_validation_errors, install_error_handlers
from splitserve.server.logprobs import logprobs_object
from splitserve.server.protocol import (
    BaseGenerateRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormatter,
    Usage,
)
from splitserve.server.stop_strings import StopStringMatcher

MODEL_ALIAS = "default"  # accepted as ``model`` whatever the served model is called


@dataclass(slots=True)
class _Job:
    """One validated request, ready to generate."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stop: list[str]
    formatter: ResponseFormatter
    usage: Usage
    return_token_ids: bool = False
    output_ids: list[int] = field(default_factory=list)
    # Legacy-completions echo/logprobs (``server.logprobs``).
    echo_text: str | None = None  # the prompt's text, prepended when ``echo``
    want_logprobs: bool = False
    discard_output: bool = False  # max_tokens 0: the engine samples one token we drop
    output_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None


@dataclass(slots=True)
class _Piece:
    """Text that became final since the last piece; ``finish_reason`` set on the last."""

    text: str
    finish_reason: str | None = None


@dataclass(slots=True)
class _ServedModel:
    client: BaseEngineClient
    tokenizer: Any
    name: str
    context_len: int
    eos_token_ids: list[int]
    created: int

    # ---- request -> job ----------------------------------------------------------------------

    def check_model(self, req: BaseGenerateRequest) -> None:
        if req.model not in (self.name, MODEL_ALIAS):
            raise APIError(
                f"model: '{req.model}' is not served here; use '{self.name}'", param="model"
            )
        if req.n not in (None, 1):
            raise APIError("n: only n=1 is supported", param="n")

    def completion_ids(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            # By default a raw prompt gets BOS where the model expects one.
            return self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        vocab_size = len(self.tokenizer)
        bad = next((t for t in req.prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(f"prompt: token id {bad} is outside the vocabulary", param="prompt")
        return list(req.prompt)

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        messages = [m.as_template_dict() for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja raises on conversations the template refuses
            raise APIError(f"messages: chat template failed: {exc}", param="messages") from exc
        # The template already wrote BOS and the role markers; don't add them twice.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def make_job(self, req: BaseGenerateRequest, input_ids: list[int], is_chat: bool) -> _Job:
        prompt_param = "messages" if is_chat else "prompt"
        if not input_ids:
            raise APIError(f"{prompt_param}: the prompt is empty", param=prompt_param)
        room = self.context_len - len(input_ids)
        if room <= 0:
            raise APIError(
                f"{prompt_param}: the prompt has {len(input_ids)} tokens; the context length is "
                f"{self.context_len}, leaving no room to generate",
                param=prompt_param,
            )
        max_param, max_tokens = "max_tokens", req.max_tokens
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            max_param, max_tokens = "max_completion_tokens", req.max_completion_tokens
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                f"{max_param}: {max_tokens} new tokens + {len(input_ids)} prompt tokens exceed "
                f"the context length {self.context_len}; at most {room} allowed",
                param=max_param,
            )
        scores_prompt = isinstance(req, CompletionRequest) and req.wants_prompt_logprobs
        sampling = SamplingParams(
            # max_tokens 0 (echo only): the engine always samples a first token; it is dropped.
            max_new_tokens=room if max_tokens is None else max(1, max_tokens),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            # The chat template's end marker may differ from config's EOS; send both.
            stop_token_ids=[] if req.ignore_eos else list(self.eos_token_ids),
            ignore_eos=req.ignore_eos,
            logprob_start_len=(req.logprob_start_len or 0) if scores_prompt else -1,
            constraint=constraint_from_request(req),
        )
        rid = f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"
        fmt = ResponseFormatter(rid, int(time.time()), req.model, is_chat, req.include_usage)
        return _Job(rid, input_ids, sampling, req.stop or [], fmt, Usage(len(input_ids)),
                    req.return_token_ids)

    # ---- job -> text -------------------------------------------------------------------------

    async def stream_text(self, job: _Job) -> AsyncIterator[_Piece]:
        """One piece per engine event (text may be empty); the last has ``finish_reason``.

        Raises:
            APIError: the worker failed the request (status from ``TokenEvent.error_code``).
        """
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopStringMatcher(job.stop)
        events = self.client.generate(job.rid, job.input_ids, job.sampling)
        engine_done = False
        try:
            async for ev in events:
                if ev.error is not None:
                    engine_done = True
                    raise APIError(ev.error, status_code=ev.error_code)
                job.usage.completion_tokens += len(ev.token_ids)
                job.output_ids.extend(ev.token_ids)
                job.output_logprobs.extend(ev.logprobs)
                if ev.prompt_logprobs is not None:
                    job.prompt_logprobs = ev.prompt_logprobs
                job.usage.prompt_tokens = ev.prompt_len or job.usage.prompt_tokens
                job.usage.cached_tokens = max(job.usage.cached_tokens, ev.cached_len)
                text = stops.feed(detok.push(ev.token_ids))
                if ev.finish_reason is not None:
                    engine_done = True
                    text += stops.feed(detok.flush())
                    text += stops.flush()
                    yield _Piece(text, "stop" if stops.stopped else ev.finish_reason)
                    return
                if stops.stopped:  # engine still running: the finally aborts it
                    yield _Piece(text, "stop")
                    return
                yield _Piece(text)
            engine_done = True
            raise APIError("the engine ended the request without a finish reason", status_code=500)
        finally:
            if not engine_done:
                # Shielded: on client disconnect this runs inside a cancelled scope.
                with anyio.CancelScope(shield=True):
                    await _aclose(events)
                    await self.client.abort(job.rid)  # idempotent; covers a cancelled aclose

    async def full_response(self, job: _Job) -> dict[str, Any]:
        parts: list[str] = []
        finish = "stop"
        async with contextlib.aclosing(self.stream_text(job)) as pieces:
            async for piece in pieces:
                parts.append(piece.text)
                finish = piece.finish_reason or finish
        text = "".join(parts)
        if job.discard_output:
            text, finish, job.output_ids, job.output_logprobs = "", "length", [], []
            job.usage.completion_tokens = 0
        logprobs = None
        if job.want_logprobs:
            echoed = job.input_ids if job.echo_text is not None else []
            logprobs = logprobs_object(
                self.tokenizer, echoed, job.prompt_logprobs, job.sampling.logprob_start_len,
                job.output_ids, job.output_logprobs,
            )
        if job.echo_text is not None:
            text = job.echo_text + text
        ids = job.output_ids if job.return_token_ids else None
        prompt_ids = job.input_ids if job.return_token_ids else None
        return job.formatter.full(text, finish, job.usage, ids, logprobs, prompt_ids)

    async def streaming_response(self, job: _Job) -> Response:
        pieces = self.stream_text(job)
        try:
            # Wait for the first event before sending headers, so an error that comes first
            # (e.g. no room on the workers) is still a plain JSON error with its status.
            first = await anext(pieces)
        except BaseException:
            await pieces.aclose()
            raise
        return _SSEResponse(_sse_events(job, first, pieces))


async def _sse_events(
    job: _Job, first: _Piece, pieces: AsyncIterator[_Piece]
) -> AsyncIterator[str]:
    fmt = job.formatter
    async with contextlib.aclosing(pieces):  # type: ignore[type-var]
        if fmt.is_chat:
            yield _sse(fmt.chunk("", role=True))
        piece: _Piece | None = first
        try:
            while piece is not None:
                if piece.text or piece.finish_reason:
                    # The finish chunk of chat has an empty delta, as OpenAI sends it.
                    if piece.finish_reason and fmt.is_chat:
                        if piece.text:
                            yield _sse(fmt.chunk(piece.text))
                        yield _sse(fmt.chunk(None, piece.finish_reason))
                    else:
                        yield _sse(fmt.chunk(piece.text, piece.finish_reason))
                piece = await anext(pieces, None)
        except APIError as err:
            yield _sse(err.body())
            yield "data: [DONE]\n\n"
            return
    if fmt.include_usage:
        yield _sse(fmt.usage_chunk(job.usage))
    yield "data: [DONE]\n\n"


def _client_gone() -> Response:
    """The answer to a client that already left. Nobody reads it; its status, 499 as nginx
    logs it, marks the request in access logs."""
    return Response(status_code=499)


async def _unless_disconnected(
    request: Request, work: Callable[[], Awaitable[Any]]
) -> Any | None:
    """``work()``'s result, or None when the client disconnects first.

    Until a response starts, Starlette does not watch the connection: a non-streaming request,
    or a streaming one still waiting for its first token (a long prefill, a queue), would run to
    the end for nobody. Here the disconnect cancels ``work``, and its generator's ``finally``
    (``stream_text``) aborts the request on the workers, freeing its KV pages. The body has
    been read by now, so the next ASGI message is ``http.disconnect``. Errors of ``work``
    propagate as raised (not wrapped in an exception group).
    """
    outcome: dict[str, Any] = {}

    async def run(scope: anyio.CancelScope) -> None:
        try:
            outcome["result"] = await work()
        except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
            outcome["error"] = exc
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, tg.cancel_scope)
        while (await request.receive())["type"] != "http.disconnect":
            pass
        tg.cancel_scope.cancel()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _aclose(events: AsyncIterator[Any]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


class _SSEResponse(StreamingResponse):
    """A streaming response that notices a client going away and then closes its body.

    Starlette listens for ``http.disconnect`` only under ASGI spec < 2.4 (uvicorn's HTTP is 2.3
    today); under 2.4 it would notice only at the next failing send, i.e. not while the engine
    is between tokens. And when the disconnect lands while the body waits at a ``yield``,
    Starlette leaves the body suspended until garbage collection; here it is closed at once.
    Closing the body aborts the request on the workers (``stream_text``'s finally).
    """

    def __init__(self, content: AsyncIterator[str]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await _aclose(self.body_iterator)  # type: ignore[arg-type]


def check_echo(req: CompletionRequest) -> None:
    """The combinations of echo/logprobs this server does not serve, as 400s."""
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            "max_tokens: 0 is only allowed with echo (to score the prompt)", param="max_tokens"
        )
    if req.stream and (req.echo or req.logprobs is not None):
        raise APIError("stream: echo and logprobs are not supported with stream yet",
                       param="stream")


async def _parse(request: Request, model_cls: type[BaseGenerateRequest]) -> Any:
    """Validate the raw body ourselves: malformed JSON and bad fields both become 400."""
    body = await request.body()
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def create_app(
    client: BaseEngineClient,
    tokenizer: Any,
    model_name: str,
    context_len: int,
    eos_token_ids: list[int],
) -> FastAPI:
    """The OpenAI-compatible API for one model served through ``client``.

    Args:
        client: where requests go (the ZeroMQ worker client, or a fake in tests).
        tokenizer: the model's Hugging Face tokenizer (with a chat template for chat).
        model_name: the ``model`` clients must send (``"default"`` is accepted too).
        context_len: prompt + generated tokens may not exceed this.
        eos_token_ids: ids that end generation unless the request sets ``ignore_eos``.
    """
    served = _ServedModel(
        client, tokenizer, model_name, context_len, eos_token_ids, int(time.time())
    )
    app = FastAPI(title="splitserve", version="0.1.0")
    install_error_handlers(app)

    async def respond(request: Request, job: _Job, stream: bool | None) -> Response:
        if stream:
            sse = await _unless_disconnected(request, lambda: served.streaming_response(job))
            return _client_gone() if sse is None else sse
        body = await _unless_disconnected(request, lambda: served.full_response(job))
        return _client_gone() if body is None else JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await _parse(request, CompletionRequest)
        served.check_model(req)
        check_echo(req)
        job = served.make_job(req, served.completion_ids(req), is_chat=False)
        if req.echo:
            prompt = req.prompt
            job.echo_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        job.want_logprobs = req.logprobs is not None
        job.discard_output = req.max_tokens == 0
        return await respond(request, job, req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        served.check_model(req)
        job = served.make_job(req, served.chat_ids(req), is_chat=True)
        return await respond(request, job, req.stream)

    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": served.created,
            "owned_by": "splitserve",
            "max_model_len": context_len,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        if model not in (model_name, MODEL_ALIAS):
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


def create_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for ``app`` on the uvloop event loop (``server.run()`` blocks)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, loop="uvloop", timeout_graceful_shutdown=5
    )
    return uvicorn.Server(config)


def serve_app(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve ``app`` until interrupted (uvicorn, uvloop)."""
    create_server(app, host, port, log_level).run()
