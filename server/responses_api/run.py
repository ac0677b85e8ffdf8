"""One response's generation: its job's pieces (``server.generation.stream_text``, the chat
path's stream) through an :class:`~splitserve.server.responses_api.output.OutputBuilder` into
numbered events and the final response object.

The same run serves the three ways a response is answered: streamed (:func:`sse_events`: the
events as server-sent events, an error after the start as an ``error`` event and
``response.failed``), as one JSON body, and in the background (:meth:`ResponseRun.complete`).
The stream starts only once the first piece is in, so an error before any token is still a
plain HTTP error with its status, as on chat.
"""

from __future__ import annotations

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

    async def events(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[Event]:
        """The numbered events of the whole response, ``response.created`` first (once the
        first piece is in) and ``response.completed`` (or ``.incomplete``) last. Closing the
        iterator closes ``pieces``, which aborts the request on the workers.

        Raises:
            APIError: the worker failed the request (before or after the first event), or
                ``on_done`` did.
        """
        async with contextlib.aclosing(pieces):  # type: ignore[type-var]
            piece = await anext(pieces, None)
            for kind in ("response.created", "response.in_progress"):
                yield self.numbered({"type": kind, "response": self.body("in_progress")})
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
                yield encode(event)
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
