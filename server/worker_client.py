"""The real :class:`BaseEngineClient`: talks to prefill/decode (or colocated) workers over ZeroMQ.

Each request goes to one prefill and one decode worker at once (DESIGN.md, step 1); tokens come
back from both (the first from prefill, the rest from decode) and are put in order by their
output index.

Faults (each bounded in time; see ``server/README`` text in the faults issue note):

- A worker process that dies closes its TCP connection: a ZeroMQ socket monitor on our link to it
  sees the disconnect at once. A worker that hangs or whose host vanishes stops its heartbeat
  (a thread in the worker, so a long forward pass does not stop it): after ``dead_after_s`` it is
  declared dead. Either way its requests end: those that have not yet produced a token are re-run
  once on another healthy prefill/decode pair (under a new wire id, so a late message from the
  old attempt can never touch the new one's pages); the rest fail fast with HTTP 503. Every other
  worker of a failed request gets an abort, so its pages are freed at once, not at a timeout.
- A worker that answers again (restarted, or back from a hang) is taken back.
- Overload: at most ``max_inflight_per_worker`` requests per worker; past that, 503 (the HTTP
  layer adds ``Retry-After``) instead of unbounded queues.
- Membership: workers may join at run time (:meth:`add_worker`, from ``POST /workers/register``)
  and be drained (:meth:`drain`: no new requests, running ones finish).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from splitserve.ipc.messages import (
    AbortTask,
    FlushCache,
    GenerateTask,
    RequestError,
    SamplingParams,
    StatsQuery,
    TokenBatch,
    TokenOutput,
    WorkerReady,
    WorkerStats,
    decode,
    encode,
)
from splitserve.server.engine_client import BaseEngineClient, TokenEvent
from splitserve.server.routing import create_routing_policy

logger = logging.getLogger(__name__)

HEALTH_CHECK_S = 0.5  # how often silence is checked (workers beat every 0.5 s)
MAX_RETRIES = 1  # re-runs of a request that lost a worker before producing any token
SEND_HWM = 1000


@dataclass(slots=True, eq=False)
class WorkerHandle:
    addr: str
    role: str  # "prefill" | "decode" | "colocated"
    sock: zmq.asyncio.Socket
    worker_id: str = ""
    ready: bool = False
    in_flight: int = 0
    last_seen: float = 0.0
    last_stats: dict = field(default_factory=dict)
    draining: bool = False
    registered: bool = False  # joined at run time (not given at start)
    failures: int = 0  # times declared dead
    monitor: asyncio.Task | None = None


@dataclass(slots=True)
class _Failure:
    """A worker of the request was lost (queued internally, never shown to the app)."""

    message: str
    code: int = 503
    retryable: bool = True


@dataclass(slots=True)
class _ReqState:
    queue: asyncio.Queue
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
    run time). ``dead_after_s``: a worker silent that long is declared dead and its requests end.
    ``routing``: how a prefill (or colocated) worker is picked (``server.routing``); decode
    workers go to the least loaded. ``max_inflight_per_worker``: past it, new requests get 503.
    ``curve``: optional :class:`splitserve.ipc.security.CurveKeys` for authenticated, encrypted
    worker links."""

    def __init__(
        self,
        inbox_addr: str,
        prefill: list[str] = (),
        decode: list[str] = (),
        colocated: list[str] = (),
        dead_after_s: float = 5.0,
        routing: str = "cache_aware",
        max_inflight_per_worker: int = 256,
        curve=None,
        metrics=None,
    ) -> None:
        self.inbox_addr = inbox_addr
        self.ctx = zmq.asyncio.Context()
        self.curve = curve
        self.auth = None
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            from splitserve.ipc.security import apply_curve_server, start_authenticator

            self.auth = start_authenticator(self.ctx, curve)
            apply_curve_server(self.inbox, curve)
        self.inbox.bind(inbox_addr)
        self.started = False
        self.workers: list[WorkerHandle] = []
        self.by_addr: dict[str, WorkerHandle] = {}
        for role, addrs in (("prefill", prefill), ("decode", decode), ("colocated", colocated)):
            for addr in addrs:
                self._new_handle(role, addr)
        self.dead_after_s = dead_after_s
        self.routing = create_routing_policy(routing)
        self.max_inflight_per_worker = max_inflight_per_worker
        self.metrics = metrics
        self.reqs: dict[str, _ReqState] = {}  # by wire rid
        self.wire_rid: dict[str, str] = {}  # app rid -> current wire rid
        self.stats_waiters: dict[int, asyncio.Future] = {}
        self.query_ids = itertools.count(1)
        self.tasks: list[asyncio.Task] = []

    def _new_handle(self, role: str, addr: str, worker_id: str = "") -> WorkerHandle:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        if self.curve is not None:
            from splitserve.ipc.security import apply_curve_client

            apply_curve_client(sock, self.curve)
        w = WorkerHandle(addr, role, sock, worker_id=worker_id)
        # Monitor before connecting, so no connect/disconnect event is missed.
        mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(addr)
        self.workers.append(w)
        self.by_addr[addr] = w
        if self.started:
            w.monitor = asyncio.create_task(self._watch(w, mon))
        else:
            w.monitor = mon  # type: ignore[assignment]  # started in start()
        return w

    async def start(self) -> None:
        """Start the reader, health and link-monitor tasks (inside the server's event loop)."""
        self.started = True
        self.tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._health())]
        for w in self.workers:
            if not isinstance(w.monitor, asyncio.Task):
                w.monitor = asyncio.create_task(self._watch(w, w.monitor))

    async def close(self) -> None:
        for t in self.tasks + [w.monitor for w in self.workers if w.monitor]:
            t.cancel()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)

    def is_ready(self) -> bool:
        """Every worker given at start has reported ready once, and some can serve now (one dead
        worker of many does not take the whole router out of a load balancer)."""
        static = [w for w in self.workers if not w.registered]
        if any(not (w.ready or w.failures) for w in static):
            return False
        roles = {w.role for w in self.workers if w.ready}
        return "colocated" in roles or {"prefill", "decode"} <= roles

    # ---- membership ---------------------------------------------------------------------------

    def add_worker(self, role: str, addr: str, worker_id: str) -> WorkerHandle:
        """Register a worker that joined at run time (idempotent by address). It takes requests
        once it reports ready over ZeroMQ."""
        w = self.by_addr.get(addr)
        if w is None:
            w = self._new_handle(role, addr, worker_id)
            w.registered = True
            logger.info("%s worker %s registered at %s", role, worker_id, addr)
        w.worker_id = worker_id or w.worker_id
        return w

    def find(self, worker_id: str) -> WorkerHandle | None:
        return next((w for w in self.workers if w.worker_id == worker_id), None)

    def drain(self, worker_id: str, draining: bool = True) -> WorkerHandle | None:
        """Stop (or resume) sending new requests to ``worker_id``; its running requests finish."""
        w = self.find(worker_id)
        if w is not None:
            w.draining = draining
        return w

    # ---- requests -------------------------------------------------------------------------------

    def _pick(self, role: str, input_ids: list[int] | None = None) -> WorkerHandle | None:
        """A live, not draining worker of ``role``: by the routing policy for the roles that
        cache prefixes (``input_ids`` given), else the least loaded."""
        live = [w for w in self.workers if w.role == role and w.ready and not w.draining]
        if not live:
            return None
        if input_ids is not None:
            return self.routing.pick(live, input_ids)  # type: ignore[return-value]
        return min(live, key=lambda w: w.in_flight)

    def _targets(self, input_ids: list[int]) -> list[tuple[WorkerHandle, str | None]] | TokenEvent:
        colocated = self._pick("colocated", input_ids)
        if colocated is not None:
            targets = [(colocated, None)]
        else:
            p, d = self._pick("prefill", input_ids), self._pick("decode")
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

    async def generate(
        self, rid: str, input_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        timer = self.metrics.request_timer() if self.metrics else None
        for attempt in itertools.count():
            targets = self._targets(input_ids)
            if isinstance(targets, TokenEvent):
                if timer:
                    timer.rejected()
                yield targets
                return
            wire = rid if attempt == 0 else f"{rid}.retry{attempt}"
            workers = [w for w, _ in targets]
            state = _ReqState(asyncio.Queue(), workers, counted=list(workers))
            state.prefill = next((w for w, _ in targets if w.role == "prefill"), None)
            self.reqs[wire] = state
            self.wire_rid[rid] = wire
            outcome = "closed"
            try:
                for w, prefill_addr in targets:
                    w.in_flight += 1
                    task = GenerateTask(
                        rid=wire, input_ids=input_ids, sampling=sampling,
                        reply_addr=self.inbox_addr, prefill_addr=prefill_addr,
                    )
                    await w.sock.send(encode(task))
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
        await self.abort_on(wire, state.workers if state else self.workers)

    async def abort_on(self, rid: str, workers: list[WorkerHandle]) -> None:
        for w in workers:
            try:
                await w.sock.send(encode(AbortTask(rid)), zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("abort of %s not delivered to %s", rid, w.addr)

    # ---- replies --------------------------------------------------------------------------------

    async def _reader(self) -> None:
        while True:
            frames = await self.inbox.recv_multipart()
            try:
                msg = decode(frames[0])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("dropped malformed worker message: %s", exc)
                continue
            if isinstance(msg, TokenBatch):
                for out in msg.outputs:
                    self._on_tokens(out)
            elif isinstance(msg, RequestError):
                state = self.reqs.get(msg.rid)
                if state is not None and not state.done:
                    state.queue.put_nowait(TokenEvent([], [], error=msg.message, error_code=msg.code))
            elif isinstance(msg, WorkerReady):
                w = self.by_addr.get(msg.addr)
                if w is not None:
                    w.worker_id = msg.worker_id
                    self._alive(w)
                    logger.info("%s worker %s ready at %s", msg.role, msg.worker_id, msg.addr)
            elif isinstance(msg, WorkerStats):
                self._on_stats(msg)

    def _on_tokens(self, out: TokenOutput) -> None:
        state = self.reqs.get(out.rid)
        if state is None:
            return
        # Tokens are a sign of life too: the first comes from prefill, the rest from decode.
        src = state.prefill if out.index == 0 and state.prefill else state.workers[0]
        if src.ready:
            src.last_seen = time.monotonic()
        state.pending[out.index] = out
        while state.next_index in state.pending:
            o = state.pending.pop(state.next_index)
            state.next_index += len(o.token_ids)
            state.queue.put_nowait(
                TokenEvent(o.token_ids, o.logprobs, o.finish_reason,
                           prompt_len=o.prompt_len, cached_len=o.cached_len,
                           prompt_logprobs=o.prompt_logprobs)
            )

    def _on_stats(self, msg: WorkerStats) -> None:
        for w in self.workers:
            if w.worker_id == msg.worker_id:
                w.last_stats = msgspec.structs.asdict(msg)
                w.last_stats.pop("query_id", None)
                self._alive(w)
        fut = self.stats_waiters.pop(msg.query_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    # ---- health -------------------------------------------------------------------------------

    def _alive(self, w: WorkerHandle) -> None:
        w.last_seen = time.monotonic()
        if not w.ready:
            if w.failures:
                logger.warning("%s worker %s at %s is back", w.role, w.worker_id, w.addr)
            w.ready = True

    async def _health(self) -> None:
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(HEALTH_CHECK_S)
            now = time.monotonic()
            # If this loop itself stalled (GC, CPU starvation), the beats that came meanwhile are
            # still unread in the inbox: credit the stall to every worker instead of blaming them.
            stall = now - last_tick - HEALTH_CHECK_S
            last_tick = now
            if stall > HEALTH_CHECK_S:
                for w in self.workers:
                    w.last_seen += stall
                continue
            for w in self.workers:
                if w.ready and now - w.last_seen > self.dead_after_s:
                    self._declare_dead(w, f"sent no heartbeat for {self.dead_after_s:g} s")

    async def _watch(self, w: WorkerHandle, mon: zmq.asyncio.Socket) -> None:
        """A worker whose process ends drops its TCP link: fail its requests at once."""
        try:
            while True:
                event = parse_monitor_message(await mon.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and w.ready:
                    self._declare_dead(w, "lost its connection")
        finally:
            mon.close(0)

    def _declare_dead(self, w: WorkerHandle, why: str) -> None:
        logger.error("%s worker %s at %s %s", w.role, w.worker_id, w.addr, why)
        w.ready = False
        w.failures += 1
        message = f"{w.role} worker {w.worker_id} {why}"
        for state in list(self.reqs.values()):
            if state.depends_on(w) and not state.done:
                state.queue.put_nowait(_Failure(message))
        if self.metrics:
            self.metrics.worker_failures.labels(w.role).inc()

    async def _query(self, w: WorkerHandle, make_query=None, timeout_s: float = 2.0) -> dict:
        """Ask ``w`` for its ``WorkerStats`` (``make_query(query_id)`` builds the question, a
        ``StatsQuery`` by default) and merge them with what the router knows of it."""
        row = {"worker_id": w.worker_id, "role": w.role, "addr": w.addr, "in_flight": w.in_flight,
               "draining": w.draining, "failures": w.failures}
        if not w.ready:
            return {**w.last_stats, **row, "healthy": False}
        qid = next(self.query_ids)
        fut = asyncio.get_running_loop().create_future()
        self.stats_waiters[qid] = fut
        try:
            query = make_query(qid) if make_query else StatsQuery(qid, self.inbox_addr)
            await w.sock.send(encode(query), zmq.NOBLOCK)
            stats = await asyncio.wait_for(fut, timeout=timeout_s)
            out = msgspec.structs.asdict(stats)
            out.pop("query_id", None)
            return {**out, **row, "healthy": True}
        except (TimeoutError, zmq.Again):
            self.stats_waiters.pop(qid, None)
            # Busy in a long step: the heartbeat's stats are at most a beat old.
            return {**w.last_stats, **row, "healthy": w.ready}

    async def worker_stats(self) -> list[dict]:
        return list(await asyncio.gather(*(self._query(w) for w in self.workers)))

    async def flush_cache(self) -> list[dict]:
        """Flush every worker's prefix cache; their stats afterwards, one dict per worker."""
        self.routing.flush()
        return list(await asyncio.gather(*(
            self._query(w, lambda qid: FlushCache(qid, self.inbox_addr), timeout_s=30.0)
            for w in self.workers
        )))
