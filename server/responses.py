"""A job's pieces as its HTTP answer: one JSON body, or a stream of server-sent events.

Both read the :class:`Piece` s of ``server.generation.stream_text`` and shape them with the job's
``ResponseFormatter``. A streamed answer waits for its first piece before it sends headers, so an
error that comes first is still a plain JSON error with its status; an error after that is an
error event, then ``[DONE]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

from splitserve.server.disconnect import SSEResponse
from splitserve.server.errors import APIError
from splitserve.server.generation import Piece
from splitserve.server.job import Job
from splitserve.server.logprobs import logprobs_object
from splitserve.server.sse import DONE_EVENT, encode_event
from splitserve.server.tools.extract import parse_tool_calls
from splitserve.server.tools.stream import ToolCallStream, finish_reason


async def full_response(job: Job, pieces: AsyncIterator[Piece], tokenizer: Any) -> dict[str, Any]:
    """The non-streaming body of ``job``, once all of ``pieces`` are in (``tokenizer`` spells
    the tokens of the legacy ``logprobs`` object).

    Raises:
        APIError: from ``pieces`` (the worker failed the request).
    """
    parts: list[str] = []
    finish = "stop"
    async with contextlib.aclosing(pieces):  # type: ignore[type-var]
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
            tokenizer, echoed, job.prompt_logprobs, job.sampling.logprob_start_len,
            job.output_ids, job.output_logprobs,
        )
    if job.echo_text is not None:
        text = job.echo_text + text
    ids = job.output_ids if job.return_token_ids else None
    prompt_ids = job.input_ids if job.return_token_ids else None
    tool_calls = None
    if job.tool_format is not None:
        text, calls = parse_tool_calls(text, job.tool_format)
        finish = finish_reason(finish, bool(calls))
        tool_calls = [c.as_openai() for c in calls]
    return job.formatter.full(text, finish, job.usage, ids, logprobs, prompt_ids, tool_calls)


async def streaming_response(job: Job, pieces: AsyncIterator[Piece]) -> Response:
    """The SSE answer of ``job``, returned once its first piece is in.

    Raises:
        APIError: the worker failed the request before its first piece.
    """
    try:
        first = await anext(pieces)
    except BaseException:
        await pieces.aclose()  # type: ignore[attr-defined]
        raise
    if job.tool_format is not None:
        return SSEResponse(_sse_tool_events(job, first, pieces))
    return SSEResponse(_sse_events(job, first, pieces))


async def _sse_events(job: Job, first: Piece, pieces: AsyncIterator[Piece]) -> AsyncIterator[str]:
    fmt = job.formatter
    async with contextlib.aclosing(pieces):  # type: ignore[type-var]
        if fmt.is_chat:
            yield encode_event(fmt.chunk("", role=True))
        piece: Piece | None = first
        try:
            while piece is not None:
                if piece.text or piece.finish_reason:
                    # The finish chunk of chat has an empty delta, as OpenAI sends it.
                    if piece.finish_reason and fmt.is_chat:
                        if piece.text:
                            yield encode_event(fmt.chunk(piece.text))
                        yield encode_event(fmt.chunk(None, piece.finish_reason))
                    else:
                        yield encode_event(fmt.chunk(piece.text, piece.finish_reason))
                piece = await anext(pieces, None)
        except APIError as err:
            yield encode_event(err.body())
            yield DONE_EVENT
            return
    if fmt.include_usage:
        yield encode_event(fmt.usage_chunk(job.usage))
    yield DONE_EVENT


async def _sse_tool_events(job: Job, first: Piece,
                           pieces: AsyncIterator[Piece]) -> AsyncIterator[str]:
    """The SSE answer of a chat job with tools: content and tool-call deltas
    (``server.tools.stream``), never the call markup as content."""
    fmt, calls = job.formatter, ToolCallStream(job.tool_format)  # type: ignore[arg-type]
    async with contextlib.aclosing(pieces):  # type: ignore[type-var]
        yield encode_event(fmt.chunk("", role=True))
        piece: Piece | None = first
        try:
            while piece is not None:
                deltas = calls.feed(piece.text)
                if piece.finish_reason:
                    deltas += calls.finish()
                for delta in deltas:
                    yield encode_event(fmt.chunk(delta.get("content"),
                                                 tool_calls=delta.get("tool_calls")))
                if piece.finish_reason:
                    yield encode_event(fmt.chunk(None, calls.finish_reason(piece.finish_reason)))
                piece = await anext(pieces, None)
        except APIError as err:
            yield encode_event(err.body())
            yield DONE_EVENT
            return
    if fmt.include_usage:
        yield encode_event(fmt.usage_chunk(job.usage))
    yield DONE_EVENT
