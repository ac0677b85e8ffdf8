"""The worker process: one loop, the same for every role, over the parts the composition root
built (``worker.build``); what each event means is the role's policy's (``worker.role``).

One iteration (:meth:`Worker.run_once`): drain the inbox (at most ``MAX_MESSAGES_PER_STEP``
messages), hand finished grammar compiles to the policy, and the tasks whose LoRA adapter
finished loading (``worker.adapters``), tick it (deadlines, keepalives), end
the requests of routers that went away (``worker.routers``), and run one engine step if there
is work, handing its outputs to the policy. After every event the scheduler admits the
requests whose KV is coming, in arrival order, and the policy bootstraps those it admitted:
admission runs from this one place.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from splitserve.ipc.frames import Frames
from splitserve.ipc.messages import (
    AbortTask,
    FlushCache,
    GenerateTask,
    KVBootstrap,
    KVEvent,
    KVEvents,
    KVEventsQuery,
    LoadLora,
    Message,
    RouterBeat,
    Shutdown,
    StatsQuery,
    UnloadLora,
    WorkerReady,
    WorkerStats,
)
from splitserve.ipc.sockets import PeerUnreachable
from splitserve.kv_transfer.session import IllegalTransition
from splitserve.worker.adapters import WorkerAdapters
from splitserve.worker.build import kernel_report
from splitserve.worker.core_share import CoreShare, CpuPressure
from splitserve.worker.heartbeat import Heartbeat, rejoin_router
from splitserve.worker.parts import WorkerParts
from splitserve.worker.role import WorkerRole
from splitserve.worker.routers import CHECK_S, RouterWatch
from splitserve.worker.stall_watch import StallWatch
from splitserve.worker.step_keepalive import StepKeepalive
from splitserve.worker.tracing import stamp_step
from splitserve.worker.urgent_peek import UrgentPeek

logger = logging.getLogger(__name__)

MAX_MESSAGES_PER_STEP = 256  # bound the time spent draining the inbox between forward passes
COMPILE_POLL_MS = 5  # inbox wait while only grammar compiles are pending (no busy loop)


class Worker:
    """One worker process: call :meth:`serve_forever` (or, in tests, :meth:`dispatch` and
    :meth:`run_once`).

    Args:
        parts: everything it composes (``worker.build.build_parts``).
        role: its role; ``role.create_policy(parts)`` decides what each event means.
    """

    def __init__(self, parts: WorkerParts, role: WorkerRole) -> None:
        self.parts = parts
        self.role = role
        self.config = parts.config
        # The parts by name.
        self.model_config, self.weights, self.pool = parts.model_config, parts.weights, parts.pool
        self.scheduler, self.core, self.runner = parts.scheduler, parts.core, parts.core.runner
        self.grammars, self.port = parts.grammars, parts.port
        self.ctx, self.inbox, self.outbox = parts.links.ctx, parts.links.inbox, parts.links.outbox
        self.sender, self.receiver, self.sessions = parts.sender, parts.receiver, parts.sessions
        self.policy = role.create_policy(parts)
        self.adapters = WorkerAdapters(parts.lora, self.port, self.config.worker_id)
        # The traced requests' spans (worker.tracing; None: tracing off).
        self.tracer = parts.tracer
        self.port.tracer = parts.tracer
        # Which routers are still there: a gone one's requests are ended (worker.routers).
        self.routers = RouterWatch(self.outbox.link_drops, self.outbox.watch, clock=self.port.now)
        self.next_router_check = 0.0
        self.stopped = False
        # KV events go to the routers this worker reports to (serve_forever sets them).
        self.event_addrs: list[str] = []
        self.kv_seq = 0
        # The handoff's keepalives while one step runs longer than a third of the timeout
        # (worker.step_keepalive); its thread starts with the first step that has any.
        timeout_s = self.config.engine.transfer_timeout_s
        self.step_keepalive = StepKeepalive(self.ctx, timeout_s / 3, 10 * timeout_s,
                                            configure=parts.links.configure_client)
        # The host's cores shared step by step with its other workers (worker.core_share).
        c = self.config
        self.core_share = (CoreShare(c.core_share, c.core_share_slot, c.host_threads,
                                     pressure=CpuPressure())
                           if c.core_share else None)
        # Logs every thread's stack when one iteration never ends, and ends the worker past
        # the watchdog timeout (worker.stall_watch); serve_forever starts it.
        self.stall_watch: StallWatch | None = None
        # Between layers of a step, a look for a more urgent prompt (worker.urgent_peek): what it
        # receives is dispatched first in the next turn of the loop.
        self.urgent_peek = (UrgentPeek(self.inbox)
                            if role.computes_prompts and c.engine.interrupt_steps else None)
        self.runner.interrupt = None if self.urgent_peek is None else self.urgent_peek.check

    @property
    def clock(self) -> Callable[[], float]:
        """Every deadline is read from this clock (``time.monotonic``; tests swap in a fake)."""
        return self.port.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.port.clock = clock

    def now(self) -> float:
        """Seconds on :attr:`clock`."""
        return self.port.now()

    # ---- the loop -------------------------------------------------------------------------------

    def serve_forever(self, server_addrs: list[str] | None = None) -> None:
        """Serve until SIGTERM or ``Shutdown``, reporting to the routers whose inboxes are
        ``server_addrs`` (those of ``config.router_urls``, in order, as registration gave them;
        default: ``config.server_addr``)."""
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopped", True))
        c = self.config
        server_addrs = list(server_addrs or [c.server_addr])
        for addr in server_addrs:
            self.port.send(addr, WorkerReady(c.worker_id, self.role.name, c.addr))
        cache = self.scheduler.cache
        if cache.identity:
            self.event_addrs = server_addrs
            # What a restarted worker holds already (its disk tier), then the changes.
            self.scheduler.cache.drain_events()
            snapshot = self.kv_events(cache.snapshot_events(), snapshot=True)
            for addr in server_addrs:
                self.port.send(addr, snapshot)
        beat = Heartbeat(
            self.ctx, server_addrs, self.stats, configure=self.parts.links.configure_client,
            rejoin=self._rejoin if c.router_urls else None,
        )
        beat.start()
        self.stall_watch = StallWatch(c.worker_id, exit_after_s=c.engine.watchdog_timeout_s)
        self.stall_watch.start()
        try:
            while not self.stopped:
                self.run_once(idle_wait_ms=20)
        finally:
            self.stall_watch.stop()
            beat.stop()
            beat.join()
            self.close()

    def close(self) -> None:
        """Release what the worker holds, threads with sockets before the context ends: the
        step keepalive, grammar compiles, adapter loads, the engine, the tracer, the role's
        transfer backend, the links. (In tests: end an in-process worker with this; a worker
        dropped in a reference cycle would end its ZeroMQ context before its sockets, which
        blocks.)"""
        self.step_keepalive.close()
        if self.core_share is not None:
            self.core_share.close()
        self.grammars.close()
        self.adapters.close()
        self.core.close()
        if self.tracer is not None:
            self.tracer.close()
        # Backend threads (mooncake/nixl writers, nixl's progress thread) stop before the
        # interpreter exits: a nixl thread still inside UCX at exit crashed the process.
        self.policy.close()
        self.parts.links.close()

    def run_once(self, idle_wait_ms: int = 0) -> None:
        """One iteration: messages, compiles, ticks, routers, then one step if there is work."""
        if self.stall_watch is not None:
            self.stall_watch.turn()
        # Work that cannot be scheduled (waiting for pages) must not spin the core the model
        # uses; the poll still returns at once when a message arrives.
        busy = self.scheduler.has_work and self.scheduler.last_num_scheduled > 0
        waits_on_threads = (len(self.grammars) or len(self.adapters)
                            or self.scheduler.cache.is_loading)
        wait_ms = 0 if busy else COMPILE_POLL_MS if waits_on_threads else idle_wait_ms
        if self.urgent_peek is not None:
            kept = self.urgent_peek.drain()
            for item in kept:  # received during the last step: older than what waits
                self.dispatch(*item)
            if kept:  # work may have come with them: no idle wait on the socket
                wait_ms = 0
        if self.inbox.poll(wait_ms):
            for _ in range(MAX_MESSAGES_PER_STEP):
                item = self.inbox.recv()
                if item is None:
                    break
                self.dispatch(*item)
        tracer = self.tracer
        for done in self.grammars.poll():
            if tracer is not None:
                tracer.mark(done.req.rid, "compiled")
            self._handle(self.policy.on_compiled, done)
        if self.adapters.loads:
            for task in self.adapters.poll():
                self._handle(self.policy.on_task, task)
        now = self.now()
        self._handle(self.policy.on_tick, now)
        if now >= self.next_router_check:
            self.next_router_check = now + CHECK_S
            self._handle(self.check_routers, now)
            if tracer is not None:
                tracer.sweep(time.time())
        if self.scheduler.has_work:
            self._step()
            self.publish_kv_events()
        elif self.core_share is not None:
            self.core_share.idle()

    def _step(self) -> None:
        """One engine step; its stage stamps (``worker.tracing.stamp_step``); its outputs to
        the policy; the traces of the requests it finished here ended."""
        start = time.time()
        if self.core_share is not None:
            self.core_share.busy()
        self.step_keepalive.begin(self.policy.step_keepalives())
        try:
            outputs = self.core.step()
        finally:
            self.step_keepalive.end()
        if self.core_share is not None and self.scheduler.last_num_scheduled == 0:
            self.core_share.idle()  # waiting (for pages, for KV): leave the cores to others
        batch = self.core.last_batch
        if batch is not None:
            tracer = self.tracer
            stamp_step(batch, start, time.time(),
                       tracer.live if tracer is not None and tracer.live else None)
        self._handle(self.policy.on_step, outputs)
        tracer = self.tracer
        if tracer is not None and tracer.live and self.role.decodes:
            for out in outputs:
                if out.req.finish_reason is not None:
                    tracer.end(out.req.rid, "finished", out.req)

    def dispatch(self, msg: Message, frames: Frames | list) -> None:
        """Handle one inbox message: the worker's own (stats, flush, router beats, shutdown)
        here, the others by the policy; then admission."""
        try:
            if isinstance(msg, GenerateTask):
                if self.tracer is not None:
                    self.tracer.begin(msg.rid, msg.traceparent)
                if self.routers.dropped(msg.reply_addr):
                    # A router restarted at the same inbox: its predecessor's requests go first.
                    self.end_requests_of(msg.reply_addr, "closed its link")
                self.routers.heard(msg.reply_addr)
                task = self.adapters.admit(msg)  # held while its LoRA adapter loads
                if task is not None:
                    self.policy.on_task(task)
            elif isinstance(msg, AbortTask):
                if not self.adapters.drop(msg.rid):
                    self.policy.on_abort(msg.rid)
                if self.tracer is not None:
                    self.tracer.end(msg.rid, "aborted")
            elif isinstance(msg, RouterBeat):
                self.routers.heard(msg.reply_addr, msg.dead_after_s)
            elif isinstance(msg, StatsQuery):
                self.routers.heard(msg.reply_addr)
                self.port.send(msg.reply_addr, self.stats(msg.query_id))
            elif isinstance(msg, FlushCache):
                freed = self.scheduler.cache.flush()
                logger.info("%s worker %s: flushed %d cached pages", self.role.name,
                            self.config.worker_id, freed)
                self.port.send(msg.reply_addr, self.stats(msg.query_id))
            elif isinstance(msg, LoadLora):
                self.routers.heard(msg.reply_addr)
                self.adapters.on_load(msg)
            elif isinstance(msg, UnloadLora):
                self.routers.heard(msg.reply_addr)
                self.adapters.on_unload(msg)
            elif isinstance(msg, KVEventsQuery):
                self.port.send(msg.reply_addr, self.kv_events(
                    self.scheduler.cache.snapshot_events(), snapshot=True))
            elif isinstance(msg, Shutdown):
                self.stopped = True
            else:
                if self.tracer is not None and isinstance(msg, KVBootstrap):
                    self.tracer.mark(msg.rid, "bootstrap")
                self.policy.on_peer(msg, frames)
        except PeerUnreachable as exc:
            logger.warning("%s: %s", type(msg).__name__, exc)
        except IllegalTransition:
            # A message its KV transfer session cannot take (a duplicate task or bootstrap):
            # a bug in a peer or here. Loud, but the worker serves the other requests on.
            logger.exception("%s for %s dropped", type(msg).__name__, getattr(msg, "rid", "?"))
        self._admit()

    def _handle(self, on_event: Callable[[Any], None], event: Any) -> None:
        """Hand ``event`` to ``on_event``, then admit."""
        on_event(event)
        self._admit()

    def _admit(self) -> None:
        """Admission: the scheduler reserves pages for the requests whose KV is coming, in
        arrival order while they fit (``Scheduler.admit_waiting_for_kv``); the policy
        bootstraps each."""
        admitted = self.scheduler.admit_waiting_for_kv()
        if admitted:
            if self.tracer is not None:
                for req in admitted:
                    self.tracer.mark(req.rid, "admitted")
                    self.tracer.seen(req)
            self.policy.on_admitted(admitted)

    # ---- KV events (the routers' cache-aware routing, server.kv_index) -------------------------

    def kv_events(self, events: list[KVEvent], snapshot: bool = False) -> KVEvents:
        """``events`` as this worker's message: the next ``seq`` (a snapshot keeps the last)."""
        cache = self.scheduler.cache
        if not snapshot:
            self.kv_seq += 1
        return KVEvents(worker_id=self.config.worker_id, addr=self.config.addr,
                        identity=cache.identity, page_size=self.scheduler.page_size,
                        seq=self.kv_seq, events=events, snapshot=snapshot, store=cache.store_url)

    def publish_kv_events(self) -> None:
        """Send the cache tiers' changes since the last call to every router (none known: they
        are dropped; a router asks for a snapshot when it sees a gap)."""
        events = self.scheduler.cache.drain_events()
        if not events or not self.event_addrs:
            return
        msg = self.kv_events(events)
        for addr in self.event_addrs:
            try:
                self.port.send(addr, msg)
            except PeerUnreachable as exc:
                logger.debug("KV events to %s: %s", addr, exc)

    # ---- routers that went away (worker.routers) ----------------------------------------------

    def check_routers(self, now: float) -> None:
        """End the requests of every router that is gone (link closed, or silent past its
        ``dead_after_s``), freeing their pages."""
        held = {**self.policy.held(), **self.adapters.held()}
        for addr, why in self.routers.gone(now, set(held.values())):
            self.end_requests_of(addr, why, held)

    def end_requests_of(self, addr: str, why: str, held: dict[str, str] | None = None) -> None:
        """Abort every request of the router at ``addr`` (its pages freed on this worker; the
        router, if it is only cut off, gets a 503 for each should the link come back)."""
        held = {**self.policy.held(), **self.adapters.held()} if held is None else held
        rids = [rid for rid, reply in held.items() if reply == addr]
        if not rids:
            return
        logger.warning("%s worker %s: router at %s %s: ending its %d requests", self.role.name,
                       self.config.worker_id, addr, why, len(rids))
        for rid in rids:
            if not self.adapters.drop(rid):
                self.policy.on_abort(rid)
            self.port.orphan(rid, addr, f"the router at {addr} {why}: the {self.role.name} "
                                        "worker ended the request")

    def _rejoin(self, i: int) -> tuple[str, WorkerReady] | None:
        """On the heartbeat thread: register with router ``i`` of ``router_urls`` again; when
        it had forgotten us (restarted), return its inbox and the ready announcement for the
        heartbeat to send there (worker.heartbeat). Replies need no change: each request
        names its router's inbox."""
        c = self.config
        url = c.router_urls[i]
        inbox = rejoin_router(url, self.role.name, c.worker_id, c.addr, c.security.api_key)
        if inbox is None:
            return None
        logger.warning("router %s did not know this worker (restarted?): rejoined", url)
        return inbox, WorkerReady(c.worker_id, self.role.name, c.addr)

    # ---- stats --------------------------------------------------------------------------------

    def stats(self, query_id: int = 0) -> WorkerStats:
        """This worker's ``WorkerStats`` (the heartbeat's, ``GET /workers``'s)."""
        alloc = self.pool.allocator
        model = self.runner.model
        cache = self.scheduler.cache.stats()
        stats = WorkerStats(
            query_id=query_id,
            worker_id=self.config.worker_id,
            role=self.role.name,
            pages_total=alloc.num_pages - 1,
            pages_used=alloc.num_used,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_transferring=self.policy.num_transferring(),
            cache_pages=cache.cached_pages,
            cache_evictable_pages=cache.evictable_pages,
            cache_hit_tokens=cache.hit_tokens,
            cache_prompt_tokens=cache.prompt_tokens,
            cache_evicted_pages=cache.evicted_pages,
            transfer_failures=self.port.num_transfer_failures,
            requests_failed=self.port.num_failed,
            requests_orphaned=self.port.num_orphaned,
            kv_pool_bytes=self.pool.buffer.numel() * self.pool.buffer.element_size(),
            kv_cache_dtype=self.pool.layout.kv_cache_dtype,
            decode_cache_bytes=model.attn_backend.cache_bytes(),
            weight_bytes=model.weight_bytes(),
            kernel_plan=kernel_report(model, self.config.engine),
            spec_draft_tokens=self.scheduler.num_draft_tokens,
            spec_accepted_tokens=self.scheduler.num_accepted_tokens,
            steps_interrupted=self.core.num_interrupted,
            tokens_generated=self.port.num_tokens_out,
            cache_tiers=self.scheduler.cache.tier_stats(),
            prefill_tokens_per_s=self.scheduler.cache.prefill_rate(),
            node=self.config.node or socket.gethostname(),
        )
        lora = self.parts.lora
        if lora is not None:
            stats.loras, stats.loras_resident = lora.names(), lora.resident()
            stats.lora_digests = lora.digests()
        return self.policy.fill_stats(stats)
