"""Job -> text: run a job on the engine and turn its token events into final text.

:func:`stream_text` owns the request's life in the engine: it detokenizes incrementally
(``server.detokenizer``), applies the stop strings (``server.stop_strings``), records on the job
what came back (ids, logprobs, usage, the grammar the workers report they compiled), and
whenever the stream stops before the engine finished (a stop string, a client gone, an error
here) it aborts the request on the workers.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from splitserve.server.admission import retry_headers
from splitserve.server.detokenizer import IncrementalDetokenizer
from splitserve.server.engine_client import BaseEngineClient, TokenEvent
from splitserve.server.errors import APIError
from splitserve.server.job import Job
from splitserve.server.stop_strings import StopStringMatcher

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Piece:
    """Text that became final since the last piece; ``finish_reason`` set on the last.
    ``token_start``/``token_end``: the output tokens that came with it (indices into
    ``job.output_ids``), whose logprobs a streamed chunk carries. ``stop_string``: on the last
    piece of an answer a stop string ended, that string."""

    text: str
    finish_reason: str | None = None
    token_start: int = 0
    token_end: int = 0
    stop_string: str | None = None


async def stream_text(client: BaseEngineClient, tokenizer: Any, job: Job) -> AsyncIterator[Piece]:
    """One piece per engine event (text may be empty); the last has ``finish_reason``.

    Closing the iterator early (``aclose``, or cancelling the task that iterates it) aborts the
    request on the workers, freeing its KV pages. Each event's new tokens go to
    ``job.on_tokens`` as they come (the rate limiter charges its tenant there). A sibling
    choice of ``n`` > 1 waits until its lead's first event before it starts
    (``server.choices``).

    Raises:
        APIError: the worker failed the request (status from ``TokenEvent.error_code``; 429
            with ``Retry-After`` when the router's queue is full), or the engine ended it
            without a finish reason (500).
    """
    detok = IncrementalDetokenizer(tokenizer, keep_tokens=job.keep_tokens)
    stops = StopStringMatcher(job.stop)
    share = job.share
    extra = {}
    if share is not None:  # one of n choices (server.choices): the prompt is computed once
        if not job.leads_prompt:
            await share.ready.wait()
        extra["affinity"] = share.affinity
    if job.lora is not None:
        extra["lora"] = job.lora
    if job.timing is not None:
        extra["timing"] = job.timing
    if job.trace is not None:
        extra["trace"] = job.trace
    if job.tenant is not None:
        extra["tenant"] = job.tenant
    events = client.generate(job.rid, job.input_ids, job.sampling,
                             cache_namespace=job.cache_namespace, **extra)
    engine_done = False
    try:
        async for ev in events:
            if share is not None and job.leads_prompt:
                share.ready.set()  # the prompt is in the worker's cache: the siblings go
            if ev.error is not None:
                engine_done = True
                if ev.retry_after_s is not None and job.on_refused is not None and (
                        job.leads_prompt and not job.output_ids):
                    job.on_refused()  # the router's queue refused it: it never ran
                raise event_error(ev)
            start = len(job.output_ids)
            record(job, ev)
            end = len(job.output_ids)
            if job.on_tokens is not None and end > start:
                job.on_tokens(end - start)
            job.usage.prompt_tokens = ev.prompt_len or job.usage.prompt_tokens
            job.usage.cached_tokens = max(job.usage.cached_tokens, ev.cached_len)
            if ev.cached_by_tier:  # on the first output only (the worker that matched it)
                job.usage.cached_by_tier = dict(ev.cached_by_tier)
            text = stops.feed(detok.push(ev.token_ids))
            if ev.finish_reason is not None:
                engine_done = True
                text += stops.feed(detok.flush(cut=ev.finish_reason == "length"))
                text += stops.flush()
                yield Piece(text, "stop" if stops.stopped else ev.finish_reason, start, end,
                            stops.matched)
                return
            if stops.stopped:  # engine still running: the finally aborts it
                yield Piece(text, "stop", start, end, stops.matched)
                return
            yield Piece(text, None, start, end)
        engine_done = True
        raise APIError("the engine ended the request without a finish reason", status_code=500)
    finally:
        if share is not None and job.leads_prompt:
            share.ready.set()  # ended without a token: the siblings compute the prompt
        if not engine_done:
            # Shielded: on client disconnect this runs inside a cancelled scope.
            with anyio.CancelScope(shield=True):
                await aclose(events)
                await client.abort(job.rid)  # idempotent; covers a cancelled aclose
        if job.on_done is not None:
            job.on_done(job)


def event_error(ev: TokenEvent) -> APIError:
    """The API error of an error event: its status, and for an overload refusal (429) a rate
    limit error with ``Retry-After`` (``server.admission.retry_headers``)."""
    if ev.retry_after_s is None:
        return APIError(ev.error or "", status_code=ev.error_code)
    return APIError(ev.error or "", status_code=ev.error_code, type="rate_limit_error",
                    code="server_overloaded", headers=retry_headers(ev.retry_after_s))


def record(job: Job, ev: TokenEvent) -> None:
    """Add what ``ev`` brought to ``job``: tokens, logprobs, alternatives, prompt scores."""
    job.usage.completion_tokens += len(ev.token_ids)
    job.output_ids.extend(ev.token_ids)
    job.output_logprobs.extend(ev.logprobs)
    job.output_top_ids.extend(ev.top_ids)
    job.output_top_logprobs.extend(ev.top_logprobs)
    if ev.prompt_logprobs is not None:
        job.prompt_logprobs = ev.prompt_logprobs
    if ev.prompt_top_ids is not None:
        job.prompt_top_ids, job.prompt_top_logprobs = ev.prompt_top_ids, ev.prompt_top_logprobs
    if ev.grammar_backend:
        record_grammar(job, ev.grammar_backend, ev.grammar_ignored)


def record_grammar(job: Job, backend: str, ignored: list[str]) -> None:
    """A worker reported the grammar compile it samples ``job`` under: ``backend`` replaces an
    earlier report's (the decode worker's comes after the prefill worker's and constrains every
    token but the first); ``ignored`` (``"keyword at /pointer"``) adds to the earlier ones (the
    output was held to a keyword only where every reporter enforced it)."""
    if job.grammar_backend and job.grammar_backend != backend:
        logger.warning("request %s: grammar compiled by %s on one worker, %s on the next",
                       job.rid, job.grammar_backend, backend)
    job.grammar_backend = backend
    job.grammar_ignored = list(dict.fromkeys([*job.grammar_ignored, *ignored]))


async def aclose(iterator: AsyncIterator[Any]) -> None:
    """Close ``iterator`` if it can be closed (async generators can; other iterators may not)."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()
