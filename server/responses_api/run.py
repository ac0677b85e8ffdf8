"""One response's generation: its job's pieces (``server.generation.stream_text``, the chat
path's stream) through an :class:`~splitserve.server.responses_api.output.OutputBuilder` into
numbered events and the final response object.

The same run serves the three ways a response is answered: streamed (:func:`sse_events`: the
events as server-sent events, an error after the start as an ``error`` event and
``response.failed``), as one JSON body, and in the background (:meth:`ResponseRun.complete`).
The stream starts once the first piece is in, so an error before any token is still a plain
HTTP error with its status, as on chat; but it waits at most :data:`FIRST_PIECE_WAIT_S`: a
first piece that takes longer (an agent's long prompt prefilled on a CPU) starts the stream
with ``response.created`` and ``response.in_progress``, and an SSE comment (``: keepalive``,
which SSE clients skip) goes out every :data:`KEEPALIVE_S` until it comes, so a client's idle
timeout (Codex: 300 s) does not end a healthy request. An error while waiting is then an
``error`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from splitserve.server.errors import APIError
from splitserve.server.generation import Piece
from splitserve.server.job import Job
from splitserve.server.logprobs import chat_logprobs
from splitserve.server.responses_api.envelope import Envelope, error_code, usage_body
from splitserve.server.responses_api.output import Event, OutputBuilder
from splitserve.server.responses_api.translate import FunctionNames
from splitserve.server.token_text import TokenSpeller

logger = logging.getLogger(__name__)

FIRST_PIECE_WAIT_S = 5.0  # the stream waits this long for the first piece, then starts without
KEEPALIVE_S = 10.0  # while the first piece is still coming, an SSE comment this often
KEEPALIVE = None  # what :meth:`ResponseRun.events` yields for one (no event: nothing numbered)


class ReasoningSplit(Protocol):
    """Splits an answer's text, as it streams, into thinking and visible text (a reasoning
    parser). ``feed`` returns ``(reasoning_delta, content_delta)`` for the next piece."""

    def feed(self, text: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...


class ResponseRun:
    """Runs one response's job and keeps its state.

    Args:
        envelope: the response object's request side.
        job: the chat path's job for it (``tool_format`` set when calls are parsed).
        speller: spells tokens for logprobs.
        logprobs: output text carries its tokens' logprobs.
        reasoning: the reasoning parser of this answer (default: the job's,
            ``server.reasoning``, where the server has a reasoning parser; else all text is
            visible).
        on_done: awaited with the final response object before the last event goes out (the
            store's write); raising fails the response.
    """

    def __init__(self, envelope: Envelope, job: Job, speller: TokenSpeller,
                 logprobs: bool = False, reasoning: ReasoningSplit | None = None,
                 on_done: Callable[[dict[str, Any]], Awaitable[None]] | None = None) -> None:
        self.envelope, self.job, self.speller = envelope, job, speller
        self.builder = OutputBuilder(job.tool_format, logprobs,
                                     FunctionNames.of(envelope.req).split, job.tool_functions)
        if reasoning is None and job.reasoning is not None and job.splits_reasoning:
            reasoning = job.reasoning.parser()
        self.reasoning = reasoning
        self.on_done = on_done
        self.status = "in_progress"
        self.error: dict[str, Any] | None = None
        self.reasoning_tokens = 0
        self._seq = 0

    @property
    def response_id(self) -> str:
        return self.envelope.response_id

    def body(self, status: str | None = None) -> dict[str, Any]:
        """The response object now (or in ``status``): the items built so far and the usage
        once the answer ended."""
        status = status or self.status
        usage = None if status in ("queued", "in_progress") else usage_body(
            self.job.usage, self.reasoning_tokens)
        return self.envelope.body(status, list(self.builder.items), usage, self.error)

    def fail(self, err: APIError) -> dict[str, Any]:
        """Mark the response failed by ``err``; its response object."""
        self.status = "failed"
        self.error = {"code": error_code(err.status_code), "message": err.message}
        return self.body()

    def numbered(self, event: Event) -> Event:
        """``event`` with the next ``sequence_number``."""
        event["sequence_number"] = self._seq
        self._seq += 1
        return event

    async def events(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[Event | None]:
        """The numbered events of the whole response, ``response.created`` first (once the
        first piece is in, or :data:`FIRST_PIECE_WAIT_S` passed) and ``response.completed``
        (or ``.incomplete``) last; :data:`KEEPALIVE` (None) every :data:`KEEPALIVE_S` between
        a ``response.created`` sent early and the first piece. Closing the iterator closes
        ``pieces``, which aborts the request on the workers.

        Raises:
            APIError: the worker failed the request (before or after the first event), or
                ``on_done`` did.
        """
        async with contextlib.aclosing(pieces):  # type: ignore[type-var]
            first = asyncio.ensure_future(anext(pieces, None))
            try:
                started = bool((await asyncio.wait({first}, timeout=FIRST_PIECE_WAIT_S))[0])
                if not started:  # a slow first piece: start now, keep the stream alive
                    for event in self._start_events():
                        yield event
                    while not (await asyncio.wait({first}, timeout=KEEPALIVE_S))[0]:
                        yield KEEPALIVE
                piece = first.result()
            finally:  # a generator cannot be closed while the task still runs it
                if not first.done():
                    first.cancel()
                    with contextlib.suppress(BaseException):
                        await first
            if started:
                for event in self._start_events():
                    yield event
            finish = "stop"
            while piece is not None:
                for event in self._piece_events(piece):
                    yield self.numbered(event)
                finish = piece.finish_reason or finish
                piece = await anext(pieces, None)
        truncated = finish == "length"
        if self.reasoning is not None:  # what the parser held back (a partial marker)
            thought, text = self.reasoning.finish()
            for event in self.builder.feed(text, thought):
                yield self.numbered(event)
        for event in self.builder.finish(truncated):
            yield self.numbered(event)
        self.status = "incomplete" if truncated else "completed"
        body = self.body()
        if self.on_done is not None:
            await self.on_done(body)
        yield self.numbered({"type": f"response.{self.status}", "response": body})

    def _start_events(self) -> list[Event]:
        """``response.created`` and ``response.in_progress``, numbered."""
        return [self.numbered({"type": kind, "response": self.body("in_progress")})
                for kind in ("response.created", "response.in_progress")]

    async def complete(self, pieces: AsyncIterator[Piece]) -> dict[str, Any]:
        """Run to the end without streaming; the final response object.

        Raises:
            APIError: as :meth:`events`.
        """
        events = self.events(pieces)
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for _ in events:
                pass
        return self.body()

    def _piece_events(self, piece: Piece) -> list[Event]:
        text, thought = piece.text, ""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(piece.text)
            if thought and not text:
                self.reasoning_tokens += piece.token_end - piece.token_start
        logprobs = None
        if self.builder.logprobs and piece.token_end > piece.token_start:
            job, a, b = self.job, piece.token_start, piece.token_end
            logprobs = chat_logprobs(self.speller, job.output_ids[a:b], job.output_logprobs[a:b],
                                     job.output_top_ids[a:b],
                                     job.output_top_logprobs[a:b])["content"]
        return self.builder.feed(text, thought, logprobs)


async def sse_events(run: ResponseRun, pieces: AsyncIterator[Piece]) -> AsyncIterator[str]:
    """The run's events as server-sent events (``event: TYPE`` and ``data: JSON``, no
    ``[DONE]``, as OpenAI streams responses). A failure after the first event ends the stream
    with an ``error`` event and ``response.failed``.

    Raises:
        APIError: a failure before the first event (the caller answers it as plain JSON).
    """
    events = run.events(pieces)
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        started = False
        try:
            async for event in events:
                started = True
                yield ": keepalive\n\n" if event is KEEPALIVE else encode(event)
        except APIError as err:
            if not started:
                raise
            logger.warning("response %s failed while streaming: %s", run.response_id,
                           err.message)
            body = run.fail(err)
            yield encode(run.numbered({"type": "error", "code": error_code(err.status_code),
                                       "message": err.message, "param": err.param}))
            yield encode(run.numbered({"type": "response.failed", "response": body}))


def encode(event: Event) -> str:
    """One server-sent event, named by its type."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"
