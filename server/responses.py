"""A job's pieces as its HTTP answer: one JSON body, or a stream of server-sent events.

Both read the :class:`Piece` s of ``server.generation.stream_text`` and shape them with the job's
``ResponseFormatter``. A streamed answer waits for its first piece before it sends headers, so an
error that comes first is still a plain JSON error with its status; an error after that is an
error event, then ``[DONE]``. A completions request with several prompts is several jobs, whose
bodies :func:`merge_choices` joins into one answer.
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
from splitserve.server.logprobs import chat_logprobs, completion_logprobs, echoed_prompt_scores
from splitserve.server.sse import DONE_EVENT, encode_event
from splitserve.server.token_text import TokenSpeller
from splitserve.server.tools.extract import parse_tool_calls
from splitserve.server.tools.stream import ToolCallStream, finish_reason


async def full_response(
    job: Job, pieces: AsyncIterator[Piece], speller: TokenSpeller
) -> dict[str, Any]:
    """The non-streaming body of ``job``, once all of ``pieces`` are in (``speller`` spells
    the tokens of the logprobs objects).

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
        job.output_top_ids, job.output_top_logprobs = [], []
        job.usage.completion_tokens = 0
    logprobs = answer_logprobs(job, speller)
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


def answer_logprobs(job: Job, speller: TokenSpeller) -> dict[str, Any] | None:
    """The whole answer's logprobs object (chat or legacy), or None when not asked for."""
    if job.logprobs == "chat":
        return chat_logprobs(speller, job.output_ids, job.output_logprobs, job.output_top_ids,
                             job.output_top_logprobs)
    if job.logprobs != "completion":
        return None
    ids, lps = list(job.output_ids), list[float | None]()
    lps.extend(job.output_logprobs)
    top_ids, top_lps = list(job.output_top_ids), list(job.output_top_logprobs)
    if job.echo_text is not None:
        p_lps, p_ids, p_top = echoed_prompt_scores(
            len(job.input_ids), job.sampling.logprob_start_len, job.prompt_logprobs,
            job.prompt_top_ids, job.prompt_top_logprobs,
        )
        ids, lps = job.input_ids + ids, p_lps + lps
        top_ids, top_lps = p_ids + top_ids, p_top + top_lps
    if job.sampling.top_logprobs <= 0:
        return completion_logprobs(speller, ids, lps, None, None)
    return completion_logprobs(speller, ids, lps, top_ids, top_lps)


def merge_choices(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer from the bodies of a request's jobs (one per prompt, in prompt order): their
    choices with ``index`` 0..n-1, their usages summed."""
    merged = dict(bodies[0])
    merged["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    usage = {k: sum(b["usage"][k] for b in bodies)
             for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    usage["prompt_tokens_details"] = {
        "cached_tokens": sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    }
    merged["usage"] = usage
    return merged


async def streaming_response(
    job: Job, pieces: AsyncIterator[Piece], speller: TokenSpeller
) -> Response:
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
    return SSEResponse(_sse_events(job, first, pieces, speller))


class _ChunkLogprobs:
    """The logprobs object of each streamed chunk's tokens; legacy text offsets run on."""

    def __init__(self, job: Job, speller: TokenSpeller) -> None:
        self.job, self.speller, self.offset = job, speller, 0

    def of(self, piece: Piece) -> dict[str, Any] | None:
        job, a, b = self.job, piece.token_start, piece.token_end
        if job.logprobs is None or a == b:
            return None
        ids, lps = job.output_ids[a:b], job.output_logprobs[a:b]
        top_ids, top_lps = job.output_top_ids[a:b], job.output_top_logprobs[a:b]
        if job.logprobs == "chat":
            return chat_logprobs(self.speller, ids, lps, top_ids, top_lps)
        wants_top = job.sampling.top_logprobs > 0
        obj = completion_logprobs(self.speller, ids, list(lps),
                                  top_ids if wants_top else None,
                                  top_lps if wants_top else None, self.offset)
        self.offset += sum(len(t) for t in obj["tokens"])
        return obj


async def _sse_events(
    job: Job, first: Piece, pieces: AsyncIterator[Piece], speller: TokenSpeller
) -> AsyncIterator[str]:
    fmt = job.formatter
    chunk_logprobs = _ChunkLogprobs(job, speller)
    async with contextlib.aclosing(pieces):  # type: ignore[type-var]
        if fmt.is_chat:
            yield encode_event(fmt.chunk("", role=True))
        piece: Piece | None = first
        try:
            while piece is not None:
                lp = chunk_logprobs.of(piece)
                if piece.text or piece.finish_reason or lp is not None:
                    # The finish chunk of chat has an empty delta, as OpenAI sends it.
                    if piece.finish_reason and fmt.is_chat:
                        if piece.text or lp is not None:
                            yield encode_event(fmt.chunk(piece.text, logprobs=lp))
                        yield encode_event(fmt.chunk(None, piece.finish_reason))
                    else:
                        yield encode_event(fmt.chunk(piece.text, piece.finish_reason, logprobs=lp))
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
