"""A job's pieces as a Messages answer: one ``message`` object, or Anthropic's event stream.

The stream is ``message_start`` (the message with no content yet), ``ping``, each content
block's ``content_block_start`` / ``content_block_delta`` ... / ``content_block_stop``
(``messages_api.blocks``), ``message_delta`` (``stop_reason``, ``stop_sequence``, the final
``usage``) and ``message_stop``; each SSE event is named by its ``type``. As on the chat path,
the headers wait for the first piece, so an error before it is a plain JSON error with its
status; an error after it is an ``error`` event, and the stream ends there. The wait is bounded
(:data:`FIRST_PIECE_WAIT_S`): a first piece that takes longer (an agent's 18k-token prompt
prefilled on a CPU takes minutes) starts the stream without it, and a ``ping`` goes out every
:data:`PING_S` until it comes, as Anthropic's API keeps a slow stream alive; a client that hears
nothing for minutes gives up and sends the request again (Claude Code did, at 303 s). An error
while waiting is then an ``error`` event.

``stop_reason``: ``end_turn`` (the model ended its turn), ``stop_sequence`` (with the one
matched), ``tool_use`` (the answer holds calls and ended by itself), ``max_tokens``, or
``model_context_window_exceeded`` when the context window, not ``max_tokens``, cut it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from splitserve.server.disconnect import SSEResponse
from splitserve.server.errors import APIError
from splitserve.server.formatter import Usage
from splitserve.server.generation import Piece
from splitserve.server.job import Job
from splitserve.server.messages_api.blocks import BlockStream, gather_blocks
from splitserve.server.messages_api.errors import error_body

FIRST_PIECE_WAIT_S = 5.0  # the headers wait this long for the first piece, then go without it
PING_S = 10.0  # while the first piece is still coming, a ping this often


@dataclass(frozen=True, slots=True)
class Answer:
    """What one Messages request asked of the answer besides its job.

    Attributes:
        message_id: the answer's ``id`` (``msg_...``).
        model: the ``model`` the client sent, echoed back.
        max_tokens: the request's ``max_tokens`` (the job may have less room: the context).
    """

    message_id: str
    model: str
    max_tokens: int

    @property
    def warm_only(self) -> bool:
        """``max_tokens: 0``: compute the prompt (into the prefix cache), answer no content."""
        return self.max_tokens == 0


class ThinkingSplit:
    """Each piece's text as ``(content, reasoning)``: through the job's reasoning parser
    (``server.reasoning``) where its model thinks, all content otherwise."""

    def __init__(self, job: Job) -> None:
        self.parser = (job.reasoning.parser()
                       if job.reasoning is not None and job.splits_reasoning else None)

    def feed(self, text: str) -> tuple[str, str]:
        if self.parser is None:
            return text, ""
        reasoning, content = self.parser.feed(text)
        return content, reasoning

    def finish(self) -> tuple[str, str]:
        if self.parser is None:
            return "", ""
        reasoning, content = self.parser.finish()
        return content, reasoning


def stop_reason(answer: Answer, job: Job, last: Piece, made_calls: bool) -> str:
    """Anthropic's ``stop_reason`` for an answer whose last piece is ``last``."""
    if last.finish_reason == "length" or answer.warm_only:
        cut_by_context = job.sampling.max_new_tokens < answer.max_tokens
        return "model_context_window_exceeded" if cut_by_context else "max_tokens"
    if last.stop_string is not None:
        return "stop_sequence"
    return "tool_use" if made_calls else "end_turn"


def usage(job: Job, answer: Answer) -> dict[str, Any]:
    """Anthropic's ``usage``: ``input_tokens`` are the prompt tokens not read from the prefix
    cache, ``cache_read_input_tokens`` those that were (their sum is the prompt)."""
    u: Usage = job.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens,
            "output_tokens": 0 if answer.warm_only else u.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens}


def message(answer: Answer, content: list[dict[str, Any]], reason: str | None,
            stop_sequence: str | None, usage_: dict[str, Any]) -> dict[str, Any]:
    """The ``message`` object."""
    return {"id": answer.message_id, "type": "message", "role": "assistant",
            "model": answer.model, "content": content, "stop_reason": reason,
            "stop_sequence": stop_sequence, "usage": usage_}


async def full_message(job: Job, answer: Answer, pieces: AsyncIterator[Piece]) -> dict[str, Any]:
    """The non-streamed answer: every piece through one :class:`BlockStream`, gathered.

    Raises:
        APIError: from ``pieces`` (the worker failed the request).
    """
    blocks, split = BlockStream(job.tool_format), ThinkingSplit(job)
    events: list[dict[str, Any]] = []
    last = Piece("", "stop")
    async with contextlib.aclosing(pieces):  # type: ignore[type-var]
        async for piece in pieces:
            if not answer.warm_only:
                events += blocks.feed(*split.feed(piece.text))
            last = piece
    if not answer.warm_only:
        events += blocks.feed(*split.finish())
    events += blocks.finish(cut=last.finish_reason == "length")
    reason = stop_reason(answer, job, last, blocks.made_calls)
    stop_sequence = last.stop_string if reason == "stop_sequence" else None
    return message(answer, gather_blocks(events), reason, stop_sequence, usage(job, answer))


async def streaming_message(job: Job, answer: Answer, pieces: AsyncIterator[Piece],
                            first_wait_s: float | None = None,
                            ping_s: float | None = None) -> SSEResponse:
    """The streamed answer, returned once the first piece is in or ``first_wait_s`` passed
    (then the stream pings every ``ping_s`` seconds until the first piece; defaults
    :data:`FIRST_PIECE_WAIT_S`, :data:`PING_S`).

    Raises:
        APIError: the worker failed the request before its first piece, within
            ``first_wait_s``.
    """
    first_wait_s = FIRST_PIECE_WAIT_S if first_wait_s is None else first_wait_s
    ping_s = PING_S if ping_s is None else ping_s
    first = asyncio.ensure_future(anext(pieces))
    try:
        await asyncio.wait_for(asyncio.shield(first), first_wait_s)
    except TimeoutError:
        pass  # still coming: the stream starts without it
    except BaseException:
        await _close(first, pieces)
        raise
    return SSEResponse(_events(job, answer, first, pieces, ping_s))


async def _close(first: asyncio.Future[Piece], pieces: AsyncIterator[Piece]) -> None:
    """Stop waiting for the first piece, then close ``pieces`` (ends the request if running):
    a generator cannot be closed while a task still runs it."""
    if not first.done():
        first.cancel()
    with contextlib.suppress(BaseException):
        await first
    await pieces.aclose()  # type: ignore[attr-defined]


async def _events(job: Job, answer: Answer, first: asyncio.Future[Piece],
                  pieces: AsyncIterator[Piece], ping_s: float) -> AsyncIterator[str]:
    blocks, split = BlockStream(job.tool_format), ThinkingSplit(job)
    start = message(answer, [], None, None, {**usage(job, answer), "output_tokens": 0})
    yield encode({"type": "message_start", "message": start})
    yield encode({"type": "ping"})
    try:
        while not (await asyncio.wait({first}, timeout=ping_s))[0]:
            yield encode({"type": "ping"})
        piece: Piece | None = first.result()
        while piece is not None:
            if not answer.warm_only:
                for event in blocks.feed(*split.feed(piece.text)):
                    yield encode(event)
            last, piece = piece, await anext(pieces, None)
    except APIError as err:
        yield encode(error_body(err.status_code, err.message))
        return
    finally:
        await _close(first, pieces)
    tail = blocks.feed(*split.finish()) if not answer.warm_only else []
    for event in tail + blocks.finish(cut=last.finish_reason == "length"):
        yield encode(event)
    reason = stop_reason(answer, job, last, blocks.made_calls)
    stop_sequence = last.stop_string if reason == "stop_sequence" else None
    yield encode({"type": "message_delta",
                  "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                  "usage": usage(job, answer)})
    yield encode({"type": "message_stop"})


def encode(body: dict[str, Any]) -> str:
    """One server-sent event named by ``body["type"]``, carrying ``body`` as compact JSON."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return f"event: {body['type']}\ndata: {data}\n\n"
