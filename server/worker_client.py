"""The real :class:`BaseEngineClient`: talks to prefill/decode (or colocated) workers over ZeroMQ.

Each request goes to one prefill and one decode worker at once (DESIGN.md, step 1); tokens come
back from both (the first from prefill, the rest from decode) and are put in order by their
output index. A heartbeat (``StatsQuery`` every second) notices a worker that stops answering and
fails its requests with a clear error instead of letting clients hang.
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

from splitserve.messages import (
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

HEARTBEAT_S = 1.0


@dataclass(slots=True)
class WorkerHandle:
    addr: str
    role: str  # "prefill" | "decode" | "colocated"
    sock: zmq.asyncio.Socket
    worker_id: str = ""
    ready: bool = False
    in_flight: int = 0
    last_seen: float = 0.0
    last_stats: dict = field(default_factory=dict)


@dataclass(slots=True)
class _ReqState:
    queue: asyncio.Queue
    workers: list[WorkerHandle]
    counted: list[WorkerHandle]  # workers whose ``in_flight`` still counts this request
    next_index: int = 0
    pending: dict[int, TokenOutput] = field(default_factory=dict)
    done: bool = False
    failed: bool = False


class ZmqEngineClient(BaseEngineClient):
    """Args: ``inbox_addr`` to bind for replies; worker inbox addresses by role. Either
    ``colocated`` or both ``prefill`` and ``decode`` must be non-empty. ``dead_after_s``: a worker
    silent that long is declared dead and its requests fail. ``routing``: how a prefill (or
    colocated) worker is picked (``server.routing``); decode workers go to the least loaded."""

    def __init__(
        self,
        inbox_addr: str,
        prefill: list[str] = (),
        decode: list[str] = (),
        colocated: list[str] = (),
        dead_after_s: float = 30.0,
        routing: str = "cache_aware",
    ) -> None:
        if not colocated and not (prefill and decode):
            raise ValueError("need colocated workers, or both prefill and decode workers")
        self.inbox_addr = inbox_addr
        self.ctx = zmq.asyncio.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(inbox_addr)
        self.workers: list[WorkerHandle] = []
        for role, addrs in (("prefill", prefill), ("decode", decode), ("colocated", colocated)):
            for addr in addrs:
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(addr)
                self.workers.append(WorkerHandle(addr, role, sock))
        self.by_addr = {w.addr: w for w in self.workers}
        self.dead_after_s = dead_after_s
        self.routing = create_routing_policy(routing)
        self.reqs: dict[str, _ReqState] = {}
        self.stats_waiters: dict[int, asyncio.Future] = {}
        self.query_ids = itertools.count(1)
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Start the reader and heartbeat tasks (call inside the server's event loop)."""
        self.tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._heartbeat())]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.ctx.destroy(linger=0)

    def is_ready(self) -> bool:
        return all(w.ready for w in self.workers)

    # ---- requests -------------------------------------------------------------------------------

    def _pick(self, role: str, input_ids: list[int] | None = None) -> WorkerHandle | None:
        """A live worker of ``role``: by the routing policy for the roles that cache prefixes
        (``input_ids`` given), else the least loaded."""
        live = [w for w in self.workers if w.role == role and w.ready]
        if not live:
            return None
        if input_ids is not None:
            return self.routing.pick(live, input_ids)  # type: ignore[return-value]
        return min(live, key=lambda w: w.in_flight)

    async def generate(
        self, rid: str, input_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        colocated = self._pick("colocated", input_ids)
        if colocated is not None:
            targets = [(colocated, None)]
        else:
            p, d = self._pick("prefill", input_ids), self._pick("decode")
            if p is None or d is None:
                yield TokenEvent([], [], error="no healthy prefill/decode worker", error_code=503)
                return
            targets = [(d, p.addr), (p, None)]  # decode first: it starts reserving pages
        workers = [w for w, _ in targets]
        state = _ReqState(asyncio.Queue(), workers, list(workers))
        self.reqs[rid] = state
        try:
            for w, prefill_addr in targets:
                w.in_flight += 1
                task = GenerateTask(
                    rid=rid, input_ids=input_ids, sampling=sampling,
                    reply_addr=self.inbox_addr, prefill_addr=prefill_addr,
                )
                await w.sock.send(encode(task))
            while True:
                event: TokenEvent = await state.queue.get()
                if event.finish_reason or event.error:
                    state.done = True
                    state.failed = event.error is not None
                else:
                    self._prefill_done(state)
                yield event
                if state.done:
                    return
        finally:
            self.reqs.pop(rid, None)
            for w in state.counted:
                w.in_flight -= 1
            if not state.done or state.failed:
                # A failure reported by one worker (or the heartbeat) may leave the other holding
                # pages until its own timeout; abort is idempotent, so tell both now.
                await self.abort_on(rid, state.workers)

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
        state = self.reqs.get(rid)
        await self.abort_on(rid, state.workers if state else self.workers)

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
                    w.ready, w.worker_id, w.last_seen = True, msg.worker_id, time.monotonic()
                    logger.info("%s worker %s ready at %s", msg.role, msg.worker_id, msg.addr)
            elif isinstance(msg, WorkerStats):
                self._on_stats(msg)

    def _on_tokens(self, out: TokenOutput) -> None:
        state = self.reqs.get(out.rid)
        if state is None:
            return
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
                w.last_seen = time.monotonic()
                w.last_stats = msgspec.structs.asdict(msg)
        fut = self.stats_waiters.pop(msg.query_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    # ---- health -------------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            now = time.monotonic()
            for w in self.workers:
                if not w.ready:
                    continue
                if now - w.last_seen > self.dead_after_s:
                    self._declare_dead(w)
                    continue
                try:
                    await w.sock.send(encode(StatsQuery(0, self.inbox_addr)), zmq.NOBLOCK)
                except zmq.Again:
                    pass

    def _declare_dead(self, w: WorkerHandle) -> None:
        logger.error("%s worker %s at %s stopped answering", w.role, w.worker_id, w.addr)
        w.ready = False
        for rid, state in list(self.reqs.items()):
            if w in state.workers and not state.done:
                state.queue.put_nowait(TokenEvent(
                    [], [], error=f"{w.role} worker {w.worker_id} stopped responding", error_code=503
                ))

    async def worker_stats(self) -> list[dict]:
        return await self._ask_all(lambda qid: StatsQuery(qid, self.inbox_addr))

    async def flush_cache(self) -> list[dict]:
        """Flush every worker's prefix cache; their stats afterwards, one dict per worker."""
        self.routing.flush()
        return await self._ask_all(lambda qid: FlushCache(qid, self.inbox_addr), timeout_s=30.0)

    async def _ask_all(self, make_query, timeout_s: float = 2.0) -> list[dict]:
        """Send each worker ``make_query(query_id)`` and collect the ``WorkerStats`` replies."""
        out = []
        for w in self.workers:
            qid = next(self.query_ids)
            fut = asyncio.get_running_loop().create_future()
            self.stats_waiters[qid] = fut
            row = {"worker_id": w.worker_id, "role": w.role, "addr": w.addr, "healthy": w.ready}
            try:
                await w.sock.send(encode(make_query(qid)), zmq.NOBLOCK)
                stats = await asyncio.wait_for(fut, timeout=timeout_s)
                row.update(msgspec.structs.asdict(stats))
                row.pop("query_id", None)
            except (TimeoutError, zmq.Again):
                self.stats_waiters.pop(qid, None)
                row["healthy"] = False
            out.append(row)
        return out
