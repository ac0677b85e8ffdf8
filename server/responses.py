"""A job's pieces as its HTTP answer: one JSON body, or a stream of server-sent events.

Both read the :class:`Piece` s of ``server.generation.stream_text`` and shape them with the job's
``ResponseFormatter``. A streamed answer waits for its first piece before it sends headers, so an
error that comes first is still a plain JSON error with its status; an error after that is an
error event, then ``[DONE]``. A request with several choices (several prompts, ``n`` > 1:
``server.choices``) is several jobs: their bodies :func:`merge_choices` joins into one answer,
and their streams :func:`streaming_response` interleaves into one, each chunk naming its
choice's ``index``, with one usage chunk for them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

from splitserve.server.answer_stream import AnswerStream, answer_parts
from splitserve.server.choices import prompt_source, summed_usage
from splitserve.server.disconnect import SSEResponse
from splitserve.server.errors import APIError
from splitserve.server.formatter import Usage
from splitserve.server.generation import Piece
from splitserve.server.job import Job
from splitserve.server.logprobs import chat_logprobs, completion_logprobs, echoed_prompt_scores
from splitserve.server.sse import DONE_EVENT, encode_event
from splitserve.server.token_text import TokenSpeller


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
    tool_calls, reasoning = None, None
    if _splits(job):
        start = time.time()
        parts = answer_parts(job, text, finish)
        text, finish, tool_calls, reasoning = (parts.content, parts.finish_reason,
                                               parts.tool_calls, parts.reasoning)
        if job.trace is not None and tool_calls is not None:
            job.trace.stage("tool_parse", start, time.time(),
                            **{"splitserve.calls": len(tool_calls)})
    body = job.formatter.full(text, finish, job.usage, ids, logprobs, prompt_ids, tool_calls,
                              reasoning)
    body["choices"][0]["index"] = job.index
    return body


def _splits(job: Job) -> bool:
    """Whether the answer's text is split into parts (tool calls, a reasoning model's
    thinking: ``server.answer_stream``) rather than answered as it is."""
    return job.tool_format is not None or (job.reasoning is not None and job.splits_reasoning)


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
        src = prompt_source(job)  # a sibling choice reads its lead's prompt scores
        p_lps, p_ids, p_top = echoed_prompt_scores(
            len(job.input_ids), src.sampling.logprob_start_len, src.prompt_logprobs,
            src.prompt_top_ids, src.prompt_top_logprobs,
        )
        ids, lps = job.input_ids + ids, p_lps + lps
        top_ids, top_lps = p_ids + top_ids, p_top + top_lps
    if job.sampling.top_logprobs <= 0:
        return completion_logprobs(speller, ids, lps, None, None)
    return completion_logprobs(speller, ids, lps, top_ids, top_lps)


def merge_choices(jobs: list[Job], bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer from the bodies of a request's jobs (``bodies[i]`` is ``jobs[i]``'s): their
    choices in ``index`` order, the usage summed (``server.choices.summed_usage``: each prompt
    counted once)."""
    merged = dict(bodies[0])
    merged["choices"] = sorted((b["choices"][0] for b in bodies), key=lambda c: c["index"])
    merged["usage"] = summed_usage(jobs).as_dict()
    return merged


async def streaming_response(
    jobs: list[Job], pieces: list[AsyncIterator[Piece]], speller: TokenSpeller
) -> Response:
    """The SSE answer of ``jobs`` (one, or the choices of one prompt with its lead first;
    ``pieces[i]`` is ``jobs[i]``'s), returned once the lead's first piece is in.

    Raises:
        APIError: the worker failed the lead before its first piece.
    """
    try:
        first = await anext(pieces[0])
    except BaseException:
        for p in pieces:  # a sibling not started yet closes without touching the engine
            await p.aclose()  # type: ignore[attr-defined]
        raise
    sources = [_choice_chunks(job, first if i == 0 else None, p, speller)
               for i, (job, p) in enumerate(zip(jobs, pieces, strict=True))]
    return SSEResponse(_sse_events(jobs, sources))


async def _sse_events(jobs: list[Job], sources: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The events of every choice as they come, then one usage chunk (if asked) and ``[DONE]``.
    An error in any choice ends the stream with an error event (the others are aborted)."""
    fmt = jobs[0].formatter
    events = sources[0] if len(sources) == 1 else _interleave(sources)
    try:
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for event in events:
                yield event
    except APIError as err:
        yield encode_event(err.body())
        yield DONE_EVENT
        return
    timing = jobs[0].timing
    if fmt.include_usage or (timing is not None and timing.wanted):
        chunk = fmt.usage_chunk(summed_usage(jobs))
        if not fmt.include_usage:
            del chunk["usage"]
        if timing is not None and timing.wanted:
            # The timing breakdown (observe.timing), asked for with x-splitserve-timing.
            chunk["splitserve_timing"] = timing.summary(time.time())
        yield encode_event(chunk)
    yield DONE_EVENT


async def _interleave(sources: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of every source, each as soon as it is ready (one task per source). The first
    exception of any source is raised here; closing this iterator, or an exception, closes
    every source (which aborts its request on the workers)."""
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async def pump(source: AsyncIterator[Any]) -> None:
        try:
            async with contextlib.aclosing(source):  # type: ignore[type-var]
                async for item in source:
                    await queue.put(("item", item))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, raised there
            await queue.put(("error", exc))
            return
        await queue.put(("done", None))

    tasks = [asyncio.create_task(pump(s)) for s in sources]
    try:
        running = len(tasks)
        while running:
            kind, value = await queue.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                running -= 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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


async def _choice_chunks(job: Job, first: Piece | None, pieces: AsyncIterator[Piece],
                         speller: TokenSpeller) -> AsyncIterator[str]:
    """The SSE events of one choice's streamed chunks (``first``: its first piece if already
    read), each naming ``job.index``; the role chunk first (chat), its own ``finish_reason``
    last. With tools or a reasoning model's thinking, reasoning, content and tool-call deltas
    (``server.answer_stream``), never the call markup; a piece's logprobs ride on its first
    delta (or on the next one, while its text is held back).

    Raises:
        APIError: the worker failed this choice.
    """
    fmt, index, usage = job.formatter, job.index, job.usage
    chunk_logprobs = _ChunkLogprobs(job, speller)
    parts = AnswerStream(job) if _splits(job) else None
    async with contextlib.aclosing(pieces):  # type: ignore[type-var]
        if fmt.is_chat:
            # Its usage (continuous_usage) counts no token yet, though the lead's first is in.
            before = Usage(usage.prompt_tokens, 0, usage.cached_tokens)
            yield encode_event(fmt.chunk("", role=True, index=index, usage=before))
        piece = first if first is not None else await anext(pieces, None)
        held: dict[str, Any] | None = None  # logprobs of tokens whose text is held back
        while piece is not None:
            if parts is not None:
                held = _join_logprobs(held, chunk_logprobs.of(piece))
                deltas = parts.feed(piece.text)
                if piece.finish_reason:
                    deltas += parts.finish(cut=piece.finish_reason == "length")
                for delta in deltas:
                    yield encode_event(fmt.chunk(
                        delta.get("content"), index=index, usage=usage, logprobs=held,
                        tool_calls=delta.get("tool_calls"),
                        reasoning=delta.get("reasoning_content")))
                    held = None
                if piece.finish_reason:
                    yield encode_event(fmt.chunk(None, parts.finish_reason(piece.finish_reason),
                                                 index=index, usage=usage, logprobs=held))
            else:
                for event in _text_events(fmt, piece, chunk_logprobs.of(piece), index, usage):
                    yield event
            piece = await anext(pieces, None)


def _join_logprobs(held: dict[str, Any] | None,
                   new: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat logprobs objects of consecutive tokens as one (their ``content`` lists joined)."""
    if held is None or new is None:
        return held or new
    return {**held, "content": held["content"] + new["content"]}


def _text_events(fmt: Any, piece: Piece, lp: dict[str, Any] | None, index: int,
                 usage: Usage) -> list[str]:
    """The events of one piece of a choice without tools (none for an empty piece); ``usage``
    is the choice's so far (sent with ``continuous_usage``)."""
    if not (piece.finish_reason or lp is not None):
        return [fmt.text_event(piece.text, index, usage)] if piece.text else []
    if piece.finish_reason and fmt.is_chat:
        # The finish chunk of chat has an empty delta, as OpenAI sends it.
        out = []
        if piece.text or lp is not None:
            out.append(fmt.chunk(piece.text, logprobs=lp, index=index, usage=usage))
        out.append(fmt.chunk(None, piece.finish_reason, index=index, usage=usage))
        return [encode_event(chunk) for chunk in out]
    return [encode_event(fmt.chunk(piece.text, piece.finish_reason, logprobs=lp, index=index,
                                   usage=usage))]
