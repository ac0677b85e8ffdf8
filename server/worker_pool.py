"""The workers the router knows: their links, membership, health and stats.

- Membership: the workers given at start, and those that join at run time (:meth:`add_worker`,
  from ``POST /workers/register``); a worker may be drained (:meth:`drain`: no new requests,
  running ones finish) and resumed.
- Health: a worker process that dies closes its TCP connection: a ZeroMQ socket monitor on our
  link to it sees the disconnect at once. A worker that hangs or whose host vanishes stops its
  heartbeat (a thread in the worker, so a long forward pass does not stop it): after
  ``dead_after_s`` it is declared dead. Either way ``on_dead`` is called, so the requests that
  depended on it (``server.disagg_request``) re-run or end. A worker that answers again
  (restarted, or back from a hang) is taken back.
- The other way: the pool sends every worker a ``RouterBeat`` each ``HEALTH_CHECK_S`` with
  ``dead_after_s``; a worker that hears none for that long (a partition, or this router hung)
  ends this router's requests and frees their pages, as one whose link to this router dropped
  (this router exited) does at once (``worker.routers``). So several routers can share the
  workers, and a router that goes costs no page.
- Stats: each heartbeat carries the worker's ``WorkerStats``; :meth:`worker_stats` asks every
  worker afresh (``GET /workers``).

The replies to the pool's questions arrive on the router's inbox; its reader hands them to
:meth:`on_ready` and :meth:`on_stats`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from splitserve.ipc.messages import (
    FlushCache,
    KVEvents,
    KVEventsQuery,
    RouterBeat,
    StatsQuery,
    WorkerReady,
    WorkerStats,
    encode,
)
from splitserve.radix_cache.namespace import adapter_namespace
from splitserve.server.routing import create_routing_policy

logger = logging.getLogger(__name__)


def stats_dict(msg: WorkerStats) -> dict:
    """A worker's stats as plain JSON-able values (its cache tiers' rows as dicts), less the
    query id."""
    out = msgspec.structs.asdict(msg)
    out.pop("query_id", None)
    out["cache_tiers"] = [msgspec.structs.asdict(t) for t in msg.cache_tiers]
    return out


HEALTH_CHECK_S = 0.5  # how often silence is checked (workers beat every 0.5 s)
SEND_HWM = 1000
ADAPTER_SLACK = 8  # requests in flight a worker with the adapter resident may exceed the least


def _prefer_resident(live: list[WorkerHandle], adapter: str) -> list[WorkerHandle]:
    """The workers of ``live`` with ``adapter`` resident, unless there are none or they are
    more than :data:`ADAPTER_SLACK` requests busier than the least loaded; else ``live``."""
    resident = [w for w in live if adapter in w.last_stats.get("loras_resident", ())]
    if resident and (min(w.in_flight for w in resident)
                     <= min(w.in_flight for w in live) + ADAPTER_SLACK):
        return resident
    return live


@dataclass(slots=True, eq=False)
class WorkerHandle:
    """The router's view of one worker: its link, health and load (``in_flight``: requests the
    router has on it, counted and uncounted by each request's owner,
    ``server.disagg_request``)."""

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


class WorkerPool:
    """The workers of one router.

    Args:
        ctx: the router's ZeroMQ context (links to workers are PUSH sockets made in it).
        reply_addr: the router's inbox, where workers answer the pool's queries.
        on_dead: called with a worker and why, when it is declared dead.
        dead_after_s: a worker silent that long is declared dead.
        routing: how a prefill (or colocated) worker is picked (``server.routing``).
        curve: optional :class:`splitserve.ipc.security.CurveKeys` for authenticated, encrypted
            worker links.
        metrics: optional ``ServerMetrics`` (counts the workers declared dead).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        reply_addr: str,
        on_dead: Callable[[WorkerHandle, str], None],
        dead_after_s: float = 5.0,
        routing: str = "cache_aware",
        curve: Any = None,
        metrics: Any = None,
    ) -> None:
        self.ctx = ctx
        self.reply_addr = reply_addr
        self.on_dead = on_dead
        self.dead_after_s = dead_after_s
        self.routing = create_routing_policy(routing)
        self.curve = curve
        self.metrics = metrics
        self.started = False
        self.workers: list[WorkerHandle] = []
        self.by_addr: dict[str, WorkerHandle] = {}
        self.stats_waiters: dict[int, asyncio.Future] = {}
        self.query_ids = itertools.count(1)
        self.tasks: list[asyncio.Task] = []

    def connect(self, role: str, addr: str, worker_id: str = "") -> WorkerHandle:
        """Open a link to the worker of ``role`` at ``addr`` and watch it."""
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
        """Start the health and link-monitor tasks (inside the server's event loop)."""
        self.started = True
        self.tasks = [asyncio.create_task(self._health())]
        for w in self.workers:
            if not isinstance(w.monitor, asyncio.Task):
                w.monitor = asyncio.create_task(self._watch(w, w.monitor))

    def close(self) -> None:
        """Cancel the pool's tasks (the sockets go with the context)."""
        for t in self.tasks + [w.monitor for w in self.workers if w.monitor]:
            t.cancel()

    def is_ready(self) -> bool:
        """Every worker given at start has reported ready once, and some can serve now (one dead
        worker of many does not take the whole router out of a load balancer)."""
        static = [w for w in self.workers if not w.registered]
        if any(not (w.ready or w.failures) for w in static):
            return False
        roles = {w.role for w in self.workers if w.ready}
        return "colocated" in roles or {"prefill", "decode"} <= roles

    def pick(
        self, role: str, input_ids: list[int] | None = None, namespace: str | None = None,
        adapter: str | None = None,
    ) -> WorkerHandle | None:
        """A live, not draining worker of ``role``: by the routing policy for the roles that
        cache prefixes (``input_ids`` given; matched in the request's prefix-cache
        ``namespace`` only), else the least loaded; None if there is none. With a LoRA
        ``adapter`` (its name), among the workers that have it resident (their last stats)
        unless those are ``ADAPTER_SLACK`` requests busier than the least loaded (Dynamo's
        adapter-aware routing: a worker without it must first put it in a slot, maybe evicting
        another), and matched in the adapter's namespace within ``namespace``
        (:meth:`adapter_key`), the one the workers' KV events carry."""
        live = [w for w in self.workers if w.role == role and w.ready and not w.draining]
        if not live:
            return None
        if adapter is not None:
            live = _prefer_resident(live, adapter)
            namespace = adapter_namespace(namespace, self.adapter_key(adapter))
        if input_ids is not None:
            return self.routing.pick(live, input_ids, namespace)  # type: ignore[return-value]
        return min(live, key=lambda w: w.in_flight)

    def adapter_key(self, adapter: str) -> str:
        """What identifies adapter ``adapter`` (its name) in a prefix-cache namespace: the
        digest of its files that the live workers report (``WorkerStats.lora_digests``; every
        worker read the same files, ``WorkerClient.load_lora`` checks), as each worker folds it
        into its requests' namespaces, so the routing policy's match of the workers' KV events
        finds their blocks. Until a worker has reported it (the first heartbeat after a load),
        ``name:`` and the name: a namespace no KV event carries, so only the policy's own record
        of what it sent matches there. A name reloaded from other files is stale for up to a
        heartbeat: a worse placement, never a wrong block (each worker keys by its own)."""
        for w in self.workers:
            digest = w.last_stats.get("lora_digests", {}).get(adapter) if w.ready else None
            if digest:
                return digest
        return f"name:{adapter}"

    # ---- membership ---------------------------------------------------------------------------

    def add_worker(self, role: str, addr: str, worker_id: str) -> WorkerHandle:
        """Register a worker that joined at run time (idempotent by address). It takes requests
        once it reports ready over ZeroMQ."""
        w = self.by_addr.get(addr)
        if w is None:
            self._forget_moved(worker_id)
            w = self.connect(role, addr, worker_id)
            w.registered = True
            logger.info("%s worker %s registered at %s", role, worker_id, addr)
        w.worker_id = worker_id or w.worker_id
        return w

    def _forget_moved(self, worker_id: str) -> None:
        """Drop the dead handle of a worker that joins again at a new address (restarted on
        another node): its heartbeats, matched by id, must not revive the old address."""
        for old in [w for w in self.workers if worker_id and w.worker_id == worker_id]:
            if old.ready:
                continue  # a live worker of that id: the caller refuses the duplicate (409)
            logger.info("%s worker %s moved from %s", old.role, worker_id, old.addr)
            self.workers.remove(old)
            self.by_addr.pop(old.addr, None)
            if isinstance(old.monitor, asyncio.Task):
                old.monitor.cancel()
            old.sock.close(0)

    def find(self, worker_id: str) -> WorkerHandle | None:
        """The worker called ``worker_id``, if known."""
        return next((w for w in self.workers if w.worker_id == worker_id), None)

    def drain(self, worker_id: str, draining: bool = True) -> WorkerHandle | None:
        """Stop (or resume) sending new requests to ``worker_id``; its running requests finish."""
        w = self.find(worker_id)
        if w is not None:
            w.draining = draining
        return w

    # ---- what workers say ---------------------------------------------------------------------

    def on_ready(self, msg: WorkerReady) -> None:
        """A worker at a known address is up (first start, restart, or back from a hang)."""
        w = self.by_addr.get(msg.addr)
        if w is not None:
            w.worker_id = msg.worker_id
            self._alive(w)
            logger.info("%s worker %s ready at %s", msg.role, msg.worker_id, msg.addr)

    def on_stats(self, msg: WorkerStats) -> None:
        """A heartbeat, or the answer to :meth:`query`."""
        for w in self.workers:
            if w.worker_id == msg.worker_id:
                w.last_stats = stats_dict(msg)
                self._alive(w)
        self.on_reply(msg.query_id, msg)

    def on_reply(self, query_id: int, msg: Any) -> None:
        """The answer to query ``query_id`` (:meth:`query`, :meth:`command`) came."""
        fut = self.stats_waiters.pop(query_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def command(self, w: WorkerHandle, make: Callable[[int], Any],
                      timeout_s: float) -> Any | None:
        """Send ``w`` the message ``make(query_id)`` and return its answer (the message with
        that ``query_id``: :meth:`on_reply`), or None if none came within ``timeout_s`` (or
        its link is full)."""
        qid = next(self.query_ids)
        fut = asyncio.get_running_loop().create_future()
        self.stats_waiters[qid] = fut
        try:
            await w.sock.send(encode(make(qid)), zmq.NOBLOCK)
            return await asyncio.wait_for(fut, timeout=timeout_s)
        except (TimeoutError, zmq.Again):
            return None
        finally:
            self.stats_waiters.pop(qid, None)

    def on_kv_events(self, msg: KVEvents) -> None:
        """A worker's KV events, for the routing policy; a gap in them asks the worker for a
        snapshot of its blocks."""
        if self.routing.observe(msg):
            return
        w = self.by_addr.get(msg.addr)
        if w is not None:
            try:
                w.sock.send(encode(KVEventsQuery(self.reply_addr)), zmq.NOBLOCK)
            except zmq.Again:
                pass  # the next gap asks again

    def heard_from(self, w: WorkerHandle) -> None:
        """A sign of life other than a heartbeat (tokens); it does not take a dead worker back."""
        if w.ready:
            w.last_seen = time.monotonic()

    # ---- health -------------------------------------------------------------------------------

    def _alive(self, w: WorkerHandle) -> None:
        w.last_seen = time.monotonic()
        if not w.ready:
            if w.failures:
                logger.warning("%s worker %s at %s is back", w.role, w.worker_id, w.addr)
            w.ready = True

    def _beat(self) -> None:
        """Tell every worker this router is alive (never blocks: a worker that is away gets
        its queue's worth)."""
        beat = encode(RouterBeat(self.reply_addr, self.dead_after_s))
        for w in self.workers:
            try:
                w.sock.send(beat, zmq.NOBLOCK)
            except zmq.Again:
                pass

    async def _health(self) -> None:
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(HEALTH_CHECK_S)
            self._beat()
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
        self.routing.forget(w.addr)
        self.on_dead(w, f"{w.role} worker {w.worker_id} {why}")
        if self.metrics:
            self.metrics.worker_failures.labels(w.role).inc()

    # ---- stats --------------------------------------------------------------------------------

    async def query(
        self, w: WorkerHandle, make_query: Callable[[int], Any] | None = None,
        timeout_s: float = 2.0,
    ) -> dict:
        """Ask ``w`` for its ``WorkerStats`` (``make_query(query_id)`` builds the question, a
        ``StatsQuery`` by default) and merge them with what the router knows of it. A worker
        that does not answer within ``timeout_s`` gets its last heartbeat's stats."""
        row = {"worker_id": w.worker_id, "role": w.role, "addr": w.addr, "in_flight": w.in_flight,
               "draining": w.draining, "failures": w.failures}
        if not w.ready:
            return {**w.last_stats, **row, "healthy": False}
        qid = next(self.query_ids)
        fut = asyncio.get_running_loop().create_future()
        self.stats_waiters[qid] = fut
        try:
            query = make_query(qid) if make_query else StatsQuery(qid, self.reply_addr)
            await w.sock.send(encode(query), zmq.NOBLOCK)
            stats = await asyncio.wait_for(fut, timeout=timeout_s)
            return {**stats_dict(stats), **row, "healthy": True}
        except (TimeoutError, zmq.Again):
            self.stats_waiters.pop(qid, None)
            # Busy in a long step: the heartbeat's stats are at most a beat old.
            return {**w.last_stats, **row, "healthy": w.ready}

    async def worker_stats(self) -> list[dict]:
        """One row per worker (:meth:`query`)."""
        return list(await asyncio.gather(*(self.query(w) for w in self.workers)))

    async def flush_cache(self) -> list[dict]:
        """Flush every worker's prefix cache; their stats afterwards, one dict per worker."""
        self.routing.flush()
        return list(await asyncio.gather(*(
            self.query(w, lambda qid: FlushCache(qid, self.reply_addr), timeout_s=30.0)
            for w in self.workers
        )))
