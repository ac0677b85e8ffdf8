"""The real :class:`BaseEngineClient`: the ZeroMQ transport between the router and its workers.

Each request is one :class:`~splitserve.server.disagg_request.DisaggRequest`, which owns its
life on the workers: which workers get its task, the merge of their tokens, in-flight counts,
retries and aborts. This client is what those requests do to the world (their
:class:`~splitserve.server.disagg_request.DisaggPort`) and the way back:

- Targets: a colocated worker, else a prefill (by the routing policy) and a decode worker (the
  least loaded), each live and not draining (``server.worker_pool``, which also keeps
  membership and health).
- Overload: at most ``max_inflight_per_worker`` requests per worker lane run at once; the rest
  wait in the admission gate (``server.admission``), tenant by tenant in deficit round robin
  (``server.fair_queue``), at most ``max_queued_per_worker`` per lane; past that, 429 with
  ``Retry-After`` instead of unbounded queues.
- Replies: the event loop's reader callback on the inbox socket hands each worker message to
  the request whose current attempt has its rid (:class:`RequestTable`), or to the pool.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from splitserve.ipc.messages import (
    AbortTask,
    KVEvents,
    LoadLora,
    LoraRef,
    LoraReply,
    RequestError,
    SamplingParams,
    TokenBatch,
    UnloadLora,
    WorkerReady,
    WorkerStats,
    decode,
    encode,
)
from splitserve.server.admission import AdmissionGate, Overload, Ticket, lanes
from splitserve.server.disagg_request import DisaggRequest, RequestTable
from splitserve.server.engine_client import BaseEngineClient, PromptAffinity, TokenEvent
from splitserve.server.errors import APIError
from splitserve.server.fair_queue import FairQueue
from splitserve.server.worker_pool import WorkerHandle, WorkerPool

logger = logging.getLogger(__name__)

MAX_DRAIN = 256  # inbox messages handled per wake-up before the other tasks get a turn
LORA_LOAD_TIMEOUT_S = 300.0  # a worker reads an adapter's files in this long, or the load fails
UNLOAD_WAIT_S = 30.0  # an unload waits this long at most for tasks accepted under the adapter
# Plain ints: the per-message socket calls skip pyzmq's enum arithmetic.
_EVENTS, _POLLIN, _RCVMORE, _NOBLOCK = (int(c) for c in (zmq.EVENTS, zmq.POLLIN, zmq.RCVMORE,
                                                          zmq.NOBLOCK))


class ZmqEngineClient(BaseEngineClient):
    """Args: ``inbox_addr`` to bind for replies; worker inbox addresses by role (more may join at
    run time, through :attr:`pool`). ``dead_after_s``: a worker silent that long is declared dead
    and its requests end. ``routing``: how a prefill (or colocated) worker is picked
    (``server.routing``); decode workers go to the least loaded. ``max_inflight_per_worker``:
    requests running per worker lane (``server.admission.lanes``); past it new ones wait, at
    most ``max_queued_per_worker`` per lane (then 429 + Retry-After), served tenant by tenant
    in deficit round robin weighted by ``tenant_weights`` (tenant -> weight, default 1;
    ``fair_queueing`` False: first come, first served); one that waits ``max_queue_wait_s``
    seconds (0: no limit) gets the same 429. ``curve``: optional
    :class:`splitserve.ipc.security.CurveKeys` for authenticated, encrypted worker links.
    ``metrics``: optional ``ServerMetrics``."""

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
        max_queued_per_worker: int = 256,
        fair_queueing: bool = True,
        tenant_weights: dict[str | None, float] | None = None,
        max_queue_wait_s: float = 0.0,
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
        self.max_queue_wait_s = max_queue_wait_s
        weights = dict(tenant_weights or {})
        self.gate = AdmissionGate(
            lambda: max_inflight_per_worker * lanes(self.pool.workers),
            lambda: max_queued_per_worker * lanes(self.pool.workers),
            lambda: FairQueue(lambda tenant: weights.get(tenant, 1.0), fair=fair_queueing))
        self.metrics = metrics
        self.requests = RequestTable()
        # LoRA adapter -> requests accepted under it whose tasks may not be out yet.
        self.sending: collections.Counter[str] = collections.Counter()
        self._all_sent: dict[str, asyncio.Event] = {}  # set when an adapter's count drops to 0
        # DisaggPort.heard_from, called per token: the pool's own, with no call in between.
        self.heard_from = self.pool.heard_from

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

    # ---- requests ----------------------------------------------------------------------------

    def generate(
        self, rid: str, input_ids: list[int], sampling: SamplingParams,
        cache_namespace: str | None = None, affinity: PromptAffinity | None = None,
        lora: LoraRef | None = None, timing: Any = None, trace: Any = None,
        tenant: str | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """``rid``'s events (``BaseEngineClient.generate``), run by its own
        :class:`DisaggRequest` once the admission gate lets it in (``tenant``: whose queue it
        waits in)."""
        req = DisaggRequest(rid, input_ids, sampling, self, self.requests,
                            cache_namespace=cache_namespace, affinity=affinity,
                            metrics=self.metrics, lora=lora, timing=timing, trace=trace)
        events = self._admitted(tenant, req.events(), sampling.priority)
        if lora is None:
            return events
        return self._sending_under(lora.name, events)

    async def _admitted(self, tenant: str | None, events: AsyncIterator[TokenEvent],
                        priority: int = 0) -> AsyncIterator[TokenEvent]:
        """``events``, started once the gate admits the request (at once while slots are
        free); its slot is given back with its last event (a reader need not close a
        finished stream), or when the stream is closed before; ``priority`` orders it at the
        gate (lower first). A full queue yields the one 429 event that refuses it, with
        ``retry_after_s`` (at once, or after waiting when a more urgent or lighter tenant's
        request takes its place), as does a wait past ``max_queue_wait_s``."""
        woken = asyncio.get_running_loop().create_future()
        ticket = self.gate.enter(tenant, lambda: woken.done() or woken.set_result(None),
                                 priority)
        if isinstance(ticket, Overload):
            await events.aclose()  # never started: nothing was sent
            yield _overloaded(ticket)
            return
        try:
            if not ticket.admitted:
                expired = await self._wait_admitted(ticket, woken)
                if expired is not None:
                    yield _overloaded(expired)
                    return
            if ticket.refusal is not None:  # pushed out of the full queue by a lighter tenant
                yield _overloaded(ticket.refusal)
                return
            async for event in events:
                if event.finish_reason is not None or event.error is not None:
                    self.gate.leave(ticket)  # the request is over on the workers
                yield event
        finally:
            self.gate.leave(ticket)
            await events.aclose()

    async def _wait_admitted(self, ticket: Ticket, woken: asyncio.Future) -> Overload | None:
        """Wait until the gate wakes ``ticket`` (admitted or pushed out), at most
        ``max_queue_wait_s`` (0: no limit); past it, the ticket leaves the queue and this
        returns its refusal (None when woken in time)."""
        if not self.max_queue_wait_s:
            await woken
            return None
        try:
            await asyncio.wait_for(asyncio.shield(woken), self.max_queue_wait_s)
        except TimeoutError:
            return self.gate.expire(ticket, self.max_queue_wait_s)  # None: woken meanwhile
        return None

    async def _sending_under(self, adapter: str,
                             events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
        """``events``, counted under ``adapter`` until the first arrives (its tasks are out by
        then) or it ends: an unload of ``adapter`` reaches the workers after those tasks
        (:meth:`unload_lora`), so a request accepted before the unload runs under it."""
        self.sending[adapter] += 1
        counted = True
        try:
            async for event in events:
                if counted:
                    counted = False
                    self._sent(adapter)
                yield event
        finally:
            if counted:
                self._sent(adapter)
            await events.aclose()

    def _sent(self, adapter: str) -> None:
        self.sending[adapter] -= 1
        if not self.sending[adapter]:
            del self.sending[adapter]
            event = self._all_sent.pop(adapter, None)
            if event is not None:
                event.set()

    # ---- LoRA adapters ---------------------------------------------------------------------------

    async def load_lora(self, name: str, path: str, pinned: bool = False) -> list[dict]:
        """``BaseEngineClient.load_lora`` over every live worker, prefill and decode pools
        alike (both hold each adapter); they read it at once, each on its own thread."""
        workers = [w for w in self.pool.workers if w.ready]
        if not workers:
            raise APIError("no live worker to load the adapter on", status_code=503)
        replies = await asyncio.gather(*(
            self.pool.command(w, lambda qid: LoadLora(qid, self.inbox_addr, name, path, pinned),
                              LORA_LOAD_TIMEOUT_S) for w in workers))
        failed = [(w, r) for w, r in zip(workers, replies, strict=True)
                  if r is None or r.error]
        digests = {r.digest for r in replies if r is not None and not r.error}
        if not failed and len(digests) > 1:
            failed = [(workers[0], LoraReply(query_id=0, worker_id=workers[0].worker_id,
                                             name=name, error="the workers read different "
                                             f"files at {path} (digests {sorted(digests)})"))]
        if failed:
            await self.unload_lora(name)  # those that loaded it drop it again
            w, r = failed[0]
            if r is None:
                raise APIError(f"{w.role} worker {w.worker_id} did not answer the load of "
                               f"{name!r} within {LORA_LOAD_TIMEOUT_S:g} s", status_code=503)
            raise APIError(f"lora_path: {r.error}", param="lora_path")
        return [_lora_row(w, r) for w, r in zip(workers, replies, strict=True)]

    async def unload_lora(self, name: str) -> list[dict]:
        """``BaseEngineClient.unload_lora`` over every live worker, once the tasks of the
        requests accepted under ``name`` are out (at most :data:`UNLOAD_WAIT_S`)."""
        if self.sending.get(name):
            event = self._all_sent.setdefault(name, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), UNLOAD_WAIT_S)
            except TimeoutError:
                logger.warning("unload of %r: requests under it still not sent after %.0f s",
                               name, UNLOAD_WAIT_S)
        workers = [w for w in self.pool.workers if w.ready]
        replies = await asyncio.gather(*(
            self.pool.command(w, lambda qid: UnloadLora(qid, self.inbox_addr, name), 30.0)
            for w in workers))
        return [_lora_row(w, r) for w, r in zip(workers, replies, strict=True)]

    async def abort(self, rid: str) -> None:
        """Close ``rid`` if it is in flight: every worker that got its current attempt's task
        is aborted, once (:meth:`RequestTable.abort`)."""
        self.requests.abort(rid)

    def _on_worker_dead(self, w: WorkerHandle, message: str) -> None:
        """The pool declared ``w`` dead: the requests that depend on it re-run or fail."""
        self.requests.worker_lost(w, message)

    # ---- what a request does (DisaggPort) --------------------------------------------------------

    def targets(
        self, input_ids: list[int], affinity: PromptAffinity | None = None,
        namespace: str | None = None, adapter: str | None = None,
    ) -> list[tuple[WorkerHandle, str | None]] | TokenEvent:
        """``(worker, prefill_addr)`` pairs to send the task to, decode first (it starts
        reserving pages), or the event that refuses it (503: no healthy worker; 429 with
        ``retry_after_s``: one of them full). With ``affinity``, the worker that computes the
        prompt is the one its first request went to, while that one is live. ``namespace``:
        the request's prefix-cache namespace, the only one the routing policy matches it in
        (with ``adapter``, the adapter's within it); ``adapter``: its LoRA adapter's name,
        preferably run where it is resident (``WorkerPool.pick``)."""
        colocated = self._prompt_worker("colocated", input_ids, affinity, namespace, adapter)
        if colocated is not None:
            targets = [(colocated, None)]
        else:
            p = self._prompt_worker("prefill", input_ids, affinity, namespace, adapter)
            d = self.pool.pick("decode", adapter=adapter)
            if p is None or d is None:
                return TokenEvent([], [], error="no healthy prefill/decode worker", error_code=503)
            targets = [(d, p.addr), (p, None)]
        # While the gate lends slots to urgent requests, a worker may hold up to twice its
        # share (the gate's own bound); its scheduler preempts for them.
        limit = self.max_inflight_per_worker * (2 if self.gate.lending else 1)
        full = [w for w, _ in targets if w.in_flight >= limit]
        if full:  # the gate admitted it, but routing picked a worker at its limit
            return TokenEvent([], [], error_code=429, retry_after_s=self.gate.retry_after_s(),
                              error=(f"server overloaded: {full[0].role} worker "
                                     f"{full[0].worker_id} has {full[0].in_flight} requests in "
                                     f"flight (limit {limit}); retry later"))
        return targets

    def _prompt_worker(
        self, role: str, input_ids: list[int], affinity: PromptAffinity | None,
        namespace: str | None = None, adapter: str | None = None,
    ) -> WorkerHandle | None:
        """The ``role`` worker to compute ``input_ids``: the affinity's worker if it is still
        live and of that role, else the routing policy's pick (recorded in the affinity)."""
        pinned = None if affinity is None else affinity.worker
        if (pinned is not None and pinned.role == role and pinned.ready and not pinned.draining
                and pinned in self.pool.workers):
            return pinned
        chosen = self.pool.pick(role, input_ids, namespace, adapter)
        if affinity is not None and chosen is not None:
            affinity.worker = chosen
        return chosen

    def send_task(self, worker: WorkerHandle, frame: bytes) -> Awaitable[Any]:
        """Send an encoded task on ``worker``'s link (awaiting it waits while the link is
        full)."""
        return worker.sock.send(frame)

    def send_abort(self, worker: WorkerHandle, rid: str) -> None:
        """Queue an abort of wire rid ``rid`` to ``worker`` behind what its link already holds,
        never blocking (a worker whose link is full or gone gets none; its own timeouts free
        the pages)."""
        sent = asyncio.ensure_future(worker.sock.send(encode(AbortTask(rid)), zmq.NOBLOCK))
        sent.add_done_callback(lambda f: _log_undelivered(f, rid, worker.addr))

    def count(self, worker: WorkerHandle) -> None:
        """One more request in flight on ``worker``."""
        worker.in_flight += 1

    def uncount(self, worker: WorkerHandle) -> None:
        """One request fewer in flight on ``worker``."""
        worker.in_flight -= 1

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
            by_wire = self.requests.by_wire
            for out in msg.outputs:
                req = by_wire.get(out.rid)
                if req is not None:
                    req.on_tokens(out)
        elif isinstance(msg, RequestError):
            req = self.requests.by_wire.get(msg.rid)
            if req is not None:
                req.on_error(msg)
        elif isinstance(msg, WorkerReady):
            self.pool.on_ready(msg)
            self.gate.dispatch()  # one more lane: waiting requests may start
        elif isinstance(msg, WorkerStats):
            self.pool.on_stats(msg)
        elif isinstance(msg, LoraReply):
            self.pool.on_reply(msg.query_id, msg)
        elif isinstance(msg, KVEvents):
            self.pool.on_kv_events(msg)


def _overloaded(refusal: Overload) -> TokenEvent:
    """The 429 event of a request the admission gate refused."""
    return TokenEvent([], [], error=refusal.message, error_code=429,
                      retry_after_s=refusal.retry_after_s)


def _lora_row(w: WorkerHandle, reply: LoraReply | None) -> dict:
    """One worker's row of a load or unload answer."""
    row = {"worker_id": w.worker_id, "role": w.role}
    if reply is None:
        return {**row, "error": "no answer"}
    return {**row, "error": reply.error, "digest": reply.digest, "rank": reply.rank,
            "load_ms": round(reply.load_s * 1e3, 1)}


def _log_undelivered(sent: asyncio.Future, rid: str, addr: str) -> None:
    """The done-callback of an abort's send: say when the link refused it (full or gone)."""
    if not sent.cancelled() and sent.exception() is not None:
        logger.warning("abort of %s not delivered to %s", rid, addr)
