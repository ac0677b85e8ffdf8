"""The real :class:`BaseEngineClient`: fans each request out to prefill/decode (or colocated)
workers over ZeroMQ and routes their replies back.

Each request goes to one prefill and one decode worker at once (DESIGN.md, step 1); tokens come
back from both (the first from prefill, the rest from decode) and are put in order by their
output index. Which workers exist and which are healthy is the pool's business
(``server.worker_pool``); this file is the requests' side:

- Targets: a colocated worker, else a prefill (by the routing policy) and a decode worker (the
  least loaded), each live and not draining.
- Overload: at most ``max_inflight_per_worker`` requests per worker; past that, 503 (the HTTP
  layer adds ``Retry-After``) instead of unbounded queues.
- A worker declared dead ends its requests: those that have not yet produced a token are re-run
  once on another healthy prefill/decode pair (under a new wire id, so a late message from the
  old attempt can never touch the new one's pages); the rest fail fast with HTTP 503. Every other
  worker of a failed request gets an abort, so its pages are freed at once, not at a timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from splitserve.ipc.messages import (
    AbortTask,
    GenerateTask,
    RequestError,
    SamplingParams,
    TokenBatch,
    TokenOutput,
    WorkerReady,
    WorkerStats,
    decode,
    encode,
)
from splitserve.server.engine_client import BaseEngineClient, PromptAffinity, TokenEvent
from splitserve.server.worker_pool import WorkerHandle, WorkerPool

logger = logging.getLogger(__name__)

MAX_RETRIES = 1  # re-runs of a request that lost a worker before producing any token
MAX_DRAIN = 256  # inbox messages handled per wake-up before the other tasks get a turn
# Plain ints: the per-message socket calls skip pyzmq's enum arithmetic.
_EVENTS, _POLLIN, _RCVMORE, _NOBLOCK = (int(c) for c in (zmq.EVENTS, zmq.POLLIN, zmq.RCVMORE,
                                                          zmq.NOBLOCK))


@dataclass(slots=True)
class _Failure:
    """A worker of the request was lost (queued internally, never shown to the app)."""

    message: str
    code: int = 503
    retryable: bool = True


class _Replies:
    """A request's replies in arrival order for its one reader, ``generate``: the part of an
    ``asyncio.Queue`` it uses (unbounded, one waiter), at a fraction of the CPU per token."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[TokenEvent | _Failure] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: TokenEvent | _Failure) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> TokenEvent | _Failure:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


@dataclass(slots=True)
class _ReqState:
    """One attempt of a request, by wire rid: its workers, and its replies put in order."""

    queue: _Replies
    workers: list[WorkerHandle]
    counted: list[WorkerHandle] = field(default_factory=list)  # whose in_flight counts it
    prefill: WorkerHandle | None = None
    next_index: int = 0
    pending: dict[int, TokenOutput] = field(default_factory=dict)
    done: bool = False

    def depends_on(self, w: WorkerHandle) -> bool:
        # Once decode has sent token 1 the KV has arrived: the prefill worker is no longer needed.
        if w is self.prefill and self.next_index > 1:
            return False
        return w in self.workers


class ZmqEngineClient(BaseEngineClient):
    """Args: ``inbox_addr`` to bind for replies; worker inbox addresses by role (more may join at
    run time, through :attr:`pool`). ``dead_after_s``: a worker silent that long is declared dead
    and its requests end. ``routing``: how a prefill (or colocated) worker is picked
    (``server.routing``); decode workers go to the least loaded. ``max_inflight_per_worker``:
    past it, new requests get 503. ``curve``: optional :class:`splitserve.ipc.security.CurveKeys`
    for authenticated, encrypted worker links. ``metrics``: optional ``ServerMetrics``."""

    def __init__(
        self,
        inbox_addr: str,
        prefill: list[str] = (),
        decode: list[str] = (),
        colocated: list[str] = (),
        dead_after_s: float = 5.0,
        routing: str = "cache_aware",
        max_inflight_per_worker: int = 256,
        curve: Any = None,
        metrics: Any = None,
    ) -> None:
        self.inbox_addr = inbox_addr
        self.ctx = zmq.asyncio.Context()
        self.auth = None
        # A plain socket, read by the event loop's reader callback (``_drain_inbox``): an
        # asyncio socket's futures cost more CPU per message than the rest of a token's path.
        self.inbox = self.ctx.socket(zmq.PULL, socket_class=zmq.Socket)
        self.inbox.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            from splitserve.ipc.security import apply_curve_server, start_authenticator

            self.auth = start_authenticator(self.ctx, curve)
            apply_curve_server(self.inbox, curve)
        self.inbox.bind(inbox_addr)
        self.pool = WorkerPool(self.ctx, inbox_addr, self._on_worker_dead, dead_after_s,
                               routing, curve, metrics)
        for role, addrs in (("prefill", prefill), ("decode", decode), ("colocated", colocated)):
            for addr in addrs:
                self.pool.connect(role, addr)
        self.max_inflight_per_worker = max_inflight_per_worker
        self.metrics = metrics
        self.reqs: dict[str, _ReqState] = {}  # by wire rid
        self.wire_rid: dict[str, str] = {}  # app rid -> current wire rid

    async def start(self) -> None:
        """Start reading replies and the pool's health tasks (inside the server's event loop)."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self.inbox.getsockopt(zmq.FD), self._drain_inbox)
        loop.call_soon(self._drain_inbox)  # what arrived before the reader was added
        await self.pool.start()

    async def close(self) -> None:
        if not self.inbox.closed:
            asyncio.get_running_loop().remove_reader(self.inbox.getsockopt(zmq.FD))
        self.pool.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)

    def is_ready(self) -> bool:
        return self.pool.is_ready()

    async def worker_stats(self) -> list[dict]:
        return await self.pool.worker_stats()

    async def flush_cache(self) -> list[dict]:
        return await self.pool.flush_cache()

    # ---- requests -------------------------------------------------------------------------------

    def _targets(
        self, input_ids: list[int], affinity: PromptAffinity | None = None,
        namespace: str | None = None,
    ) -> list[tuple[WorkerHandle, str | None]] | TokenEvent:
        """``(worker, prefill_addr)`` pairs to send the task to, or the 503 event that refuses
        it (no healthy worker, or one of them full). With ``affinity``, the worker that computes
        the prompt is the one its first request went to, while that one is live. ``namespace``:
        the request's prefix-cache namespace, the only one the routing policy matches it in."""
        colocated = self._prompt_worker("colocated", input_ids, affinity, namespace)
        if colocated is not None:
            targets = [(colocated, None)]
        else:
            p = self._prompt_worker("prefill", input_ids, affinity, namespace)
            d = self.pool.pick("decode")
            if p is None or d is None:
                return TokenEvent([], [], error="no healthy prefill/decode worker", error_code=503)
            targets = [(d, p.addr), (p, None)]  # decode first: it starts reserving pages
        full = [w for w, _ in targets if w.in_flight >= self.max_inflight_per_worker]
        if full:
            return TokenEvent([], [], error_code=503, error=(
                f"server overloaded: {full[0].role} worker {full[0].worker_id} has "
                f"{full[0].in_flight} requests in flight (limit {self.max_inflight_per_worker}); "
                "retry later"))
        return targets

    def _prompt_worker(
        self, role: str, input_ids: list[int], affinity: PromptAffinity | None,
        namespace: str | None = None,
    ) -> WorkerHandle | None:
        """The ``role`` worker to compute ``input_ids``: the affinity's worker if it is still
        live and of that role, else the routing policy's pick (recorded in the affinity)."""
        pinned = None if affinity is None else affinity.worker
        if (pinned is not None and pinned.role == role and pinned.ready and not pinned.draining
                and pinned in self.pool.workers):
            return pinned
        chosen = self.pool.pick(role, input_ids, namespace)
        if affinity is not None and chosen is not None:
            affinity.worker = chosen
        return chosen

    async def generate(
        self, rid: str, input_ids: list[int], sampling: SamplingParams,
        cache_namespace: str | None = None, affinity: PromptAffinity | None = None,
    ) -> AsyncIterator[TokenEvent]:
        timer = self.metrics.request_timer() if self.metrics else None
        for attempt in itertools.count():
            targets = self._targets(input_ids, affinity, cache_namespace)
            if isinstance(targets, TokenEvent):
                if timer:
                    timer.rejected()
                yield targets
                return
            wire = rid if attempt == 0 else f"{rid}.retry{attempt}"
            try:
                frames = [encode(GenerateTask(rid=wire, input_ids=input_ids, sampling=sampling,
                                              reply_addr=self.inbox_addr, prefill_addr=addr,
                                              cache_namespace=cache_namespace))
                          for _, addr in targets]
            except (OverflowError, msgspec.EncodeError) as exc:
                # A number the wire cannot carry (an integer past 64 bits): the request's fault,
                # refused before any worker hears of it or is counted.
                if timer:
                    timer.rejected()
                yield TokenEvent([], [], error=f"a request value is out of range: {exc}",
                                 error_code=400)
                return
            workers = [w for w, _ in targets]
            state = _ReqState(_Replies(), workers)
            state.prefill = next((w for w, _ in targets if w.role == "prefill"), None)
            self.reqs[wire] = state
            self.wire_rid[rid] = wire
            outcome = "closed"
            try:
                for w, frame in zip(workers, frames, strict=True):
                    # Counted as sent, so the finally uncounts exactly the workers counted here,
                    # whichever send fails or is cancelled.
                    w.in_flight += 1
                    state.counted.append(w)
                    await w.sock.send(frame)
                while True:
                    event = await state.queue.get()
                    if isinstance(event, _Failure):
                        if event.retryable and state.next_index == 0 and attempt < MAX_RETRIES:
                            logger.warning("re-running %s: %s", rid, event.message)
                            if self.metrics:
                                self.metrics.retries.inc()
                            outcome = "retry"
                            break
                        event = TokenEvent([], [], error=event.message, error_code=event.code)
                    if event.error:
                        outcome = "error"
                    elif event.finish_reason:
                        outcome = "finished"
                    else:
                        self._prefill_done(state)
                    if timer:
                        timer.on_event(event)
                    state.done = outcome != "closed"
                    yield event
                    if state.done:
                        return
            finally:
                self.reqs.pop(wire, None)
                if self.wire_rid.get(rid) == wire:
                    del self.wire_rid[rid]
                for w in state.counted:
                    w.in_flight -= 1
                if outcome != "finished":
                    # Closed early, failed or re-run: free the pages wherever the request lives.
                    await self.abort_on(wire, state.workers)
            if outcome != "retry":
                return

    @staticmethod
    def _prefill_done(state: _ReqState) -> None:
        """The first token is out: the prefill worker's part is (nearly) done, so it stops
        counting towards that worker's load, which the routing policy balances."""
        for w in state.counted:
            if w.role == "prefill":
                w.in_flight -= 1
                state.counted.remove(w)
                return

    async def abort(self, rid: str) -> None:
        wire = self.wire_rid.get(rid, rid)
        state = self.reqs.get(wire)
        await self.abort_on(wire, state.workers if state else self.pool.workers)

    async def abort_on(self, rid: str, workers: list[WorkerHandle]) -> None:
        """Send an abort of wire rid ``rid`` to each of ``workers``, never blocking (a worker whose
        link is full or gone gets none; its own timeouts free the pages)."""
        for w in workers:
            try:
                await w.sock.send(encode(AbortTask(rid)), zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("abort of %s not delivered to %s", rid, w.addr)

    def _on_worker_dead(self, w: WorkerHandle, message: str) -> None:
        """End the requests that still depend on ``w`` (``generate`` re-runs or fails them)."""
        for state in list(self.reqs.values()):
            if state.depends_on(w) and not state.done:
                state.queue.put_nowait(_Failure(message))

    # ---- replies --------------------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        """Handle the messages waiting in the inbox; the event loop calls this when the inbox's
        file descriptor signals. ZeroMQ signals it on an edge (new messages after it was read
        empty), so this reads until the inbox is empty, or after ``MAX_DRAIN`` messages lets
        the other tasks run and comes straight back."""
        inbox = self.inbox
        for _ in range(MAX_DRAIN):
            try:
                # Asking for EVENTS first: an empty inbox is not a zmq.Again raised and caught.
                if inbox.closed or not inbox.getsockopt(_EVENTS) & _POLLIN:
                    return
                head = inbox.recv(_NOBLOCK)
                while inbox.getsockopt(_RCVMORE):  # no message to the router has more frames
                    inbox.recv(_NOBLOCK)
            except zmq.ZMQError:  # the context is closing
                return
            try:
                self._on_message(head)
            except Exception:  # a bug in one message's handling must not stop the reader
                logger.exception("handling a worker message failed")
        asyncio.get_running_loop().call_soon(self._drain_inbox)

    def _on_message(self, head: bytes) -> None:
        try:
            msg = decode(head)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("dropped malformed worker message: %s", exc)
            return
        if isinstance(msg, TokenBatch):
            for out in msg.outputs:
                self._on_tokens(out)
        elif isinstance(msg, RequestError):
            state = self.reqs.get(msg.rid)
            if state is not None and not state.done:
                state.queue.put_nowait(TokenEvent([], [], error=msg.message, error_code=msg.code))
        elif isinstance(msg, WorkerReady):
            self.pool.on_ready(msg)
        elif isinstance(msg, WorkerStats):
            self.pool.on_stats(msg)

    def _on_tokens(self, out: TokenOutput) -> None:
        state = self.reqs.get(out.rid)
        if state is None:
            return
        # Tokens are a sign of life too: the first comes from prefill, the rest from decode.
        self.pool.heard_from(state.prefill if out.index == 0 and state.prefill else state.workers[0])
        state.pending[out.index] = out
        while state.next_index in state.pending:
            o = state.pending.pop(state.next_index)
            state.next_index += len(o.token_ids)
            state.queue.put_nowait(
                TokenEvent(o.token_ids, o.logprobs, o.finish_reason,
                           prompt_len=o.prompt_len, cached_len=o.cached_len,
                           prompt_logprobs=o.prompt_logprobs, top_ids=o.top_ids,
                           top_logprobs=o.top_logprobs, prompt_top_ids=o.prompt_top_ids,
                           prompt_top_logprobs=o.prompt_top_logprobs)
            )
