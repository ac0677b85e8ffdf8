"""The decode role: each prompt's KV comes from a prefill worker into pages the scheduler reserves
for it; then the request decodes with continuous batching (design.md, steps 2 and 4).

A request whose KV is coming is a scheduler state (``WAITING_FOR_KV``): queued in arrival order
until ``Scheduler.can_admit`` lets the scheduler reserve its prompt's pages (the worker loop
admits after every event; this policy never touches the allocator), then receiving. The handoff
of each request is one :class:`~splitserve.kv_transfer.recv_session.RecvSession` (keepalives,
deadlines and the fences of one-sided backends are documented there); this policy turns events
into that session's events:

- ``GenerateTask``: open a session (``QUEUED``), start the grammar compile if constrained, and
  queue the request in the scheduler; admitted: the session sends the ``KVBootstrap``;
- ``KVPages`` / ``KVKeepalive`` / ``KVFailed`` / ``KVReleased`` / ``AbortTask``: the session's
  events; a session whose KV is complete (``KV_READY``) hands its request back to the scheduler
  once its grammar, if any, has compiled (``Scheduler.add_received``: the first token replayed
  into the grammar, the finish and jump-forward checks);
- every tick: fenced pages whose prefill worker is gone, queued keepalives, deadlines.
"""

from __future__ import annotations

import logging
import time

from splitserve.engine.kv_pool import KVLayout
from splitserve.engine.sched.batch import StepOutput
from splitserve.engine.sched.request import Req
from splitserve.engine.sched.scheduler import Received, Scheduler
from splitserve.ipc.frames import Frames
from splitserve.ipc.messages import (
    FailureKind,
    GenerateTask,
    KVBootstrap,
    KVFailed,
    KVKeepalive,
    KVPages,
    KVReleased,
    Message,
    WeightsMsg,
    WorkerStats,
)
from splitserve.kv_transfer.base import BaseKVReceiver, layout_to_msg
from splitserve.kv_transfer.recv_session import RecvSession, RecvSessions
from splitserve.kv_transfer.session import TransferState
from splitserve.worker.grammars import CompileDone, WorkerGrammars
from splitserve.worker.outputs import decoded_outputs, token_output
from splitserve.worker.parts import WorkerParts
from splitserve.worker.port import WorkerPort
from splitserve.worker.role import WorkerRole
from splitserve.worker.tasks import new_req, task_error

logger = logging.getLogger(__name__)

T = TransferState


class DecodePolicy:
    """What the decode worker does with each event (``worker.role.RolePolicy``).

    Args:
        scheduler: the worker's scheduler; it owns every page, reserved ones included.
        sessions: the receive sessions, whose port releases through ``scheduler``.
        grammars: the worker's grammar compiles (they run while the KV travels).
        receiver: the KV transfer backend's receiver (its name and endpoint go in bootstraps).
        port: where tokens, failures and bootstraps go.
        addr: this worker's inbox (where the KV goes); ``layout``: its pool's layout;
        ``weights``: its weights' identity; ``context_len``: the model's context, in tokens.
    """

    def __init__(self, scheduler: Scheduler, sessions: RecvSessions, grammars: WorkerGrammars,
                 receiver: BaseKVReceiver, port: WorkerPort, *, addr: str, layout: KVLayout,
                 weights: WeightsMsg, context_len: int) -> None:
        self.scheduler = scheduler
        self.sessions = sessions
        self.grammars = grammars
        self.receiver = receiver
        self.port = port
        self.addr = addr
        self.layout = layout
        self.weights = weights
        self.context_len = context_len

    @classmethod
    def from_parts(cls, parts: WorkerParts) -> DecodePolicy:
        """The policy over a built decode worker's parts."""
        return cls(parts.scheduler, parts.sessions, parts.grammars, parts.receiver, parts.port,
                   addr=parts.config.addr, layout=parts.pool.layout, weights=parts.weights,
                   context_len=parts.model_config.context_len)

    # ---- events -------------------------------------------------------------------------------

    def on_task(self, task: GenerateTask) -> None:
        """Open the request's session and queue it for pages (``WAITING_FOR_KV``)."""
        error = task_error(task, self.scheduler, self.context_len)
        if error is None and task.prefill_addr is None:
            error = ("a decode worker needs the task's prefill worker (prefill_addr); "
                     "colocated serving is role colocated")
        if error is None and task.rid in self.sessions:
            error = f"request id {task.rid!r} is in use"
        if error:
            self.port.fail(task.rid, task.reply_addr, error, 400, FailureKind.INVALID)
            return
        req = new_req(task, self.scheduler, stamp="decode_received")
        if task.sampling.needs_grammar:
            self.grammars.submit(req)  # compiles while the pages are reserved and the KV travels
        self.sessions.open(req, task.prefill_addr)
        self.scheduler.add_waiting_for_kv(req)

    def on_admitted(self, reqs: list[Req]) -> None:
        """Pages are reserved for these requests: bootstrap each (its session sends it)."""
        for req in reqs:
            self.sessions.get(req.rid).reserve(req.page_ids, KVBootstrap(
                rid=req.rid,
                dst_addr=self.addr,
                page_ids=list(req.page_ids),
                layout=layout_to_msg(self.layout),
                kv_transfer=self.receiver.name,
                weights=self.weights,
                endpoint=self.receiver.endpoint(),
                lora=req.lora_id,
            ))

    def on_peer(self, msg: Message, frames: Frames | list) -> None:
        """The prefill worker's handoff messages, for the request's session."""
        if not isinstance(msg, (KVPages, KVKeepalive, KVFailed, KVReleased)):
            logger.warning("decode worker ignores %s", type(msg).__name__)
            return
        session = self.sessions.get(msg.rid)
        if session is None:
            return  # aborted or timed out: its pages are already free
        before = session.state
        if isinstance(msg, KVPages):
            session.on_pages(msg, frames)
        elif isinstance(msg, KVKeepalive):
            session.on_keepalive()
        elif isinstance(msg, KVFailed):
            session.on_kv_failed(msg.message, FailureKind.parse(msg.kind, FailureKind.TRANSFER))
        else:
            session.on_released()
        if session.state is not before:
            self._moved(session)

    def on_compiled(self, done: CompileDone) -> None:
        """Start a request whose KV already arrived; fail one whose constraint did not compile
        (a request still awaiting its KV: the prefill worker frees its copy now, too)."""
        session = self.sessions.get(done.req.rid)
        if session is None or session.req is not done.req:
            return  # aborted meanwhile
        if done.error is not None:
            session.fail(done.error, notify=True, error=done.error, code=done.code,
                         kind=FailureKind.GRAMMAR)
            self._moved(session)
        elif session.state is T.KV_READY:
            self._start(session)
        # Otherwise its KV is still on the way; _moved starts it after its last pages.

    def on_step(self, outputs: list[StepOutput]) -> None:
        """Send every sampled (and jumped-over) token."""
        self.port.emit(decoded_outputs(outputs))

    def on_abort(self, rid: str) -> None:
        """The router aborted ``rid`` (the prefill worker too): end its session (a one-sided
        transfer is fenced all the same) or take it out of the running batch."""
        self.grammars.discard(rid)
        if self.sessions.abort(rid) is None:
            self.scheduler.abort(rid)

    def on_tick(self, now: float) -> None:
        """Fenced pages whose prefill worker is gone, queued keepalives, deadlines."""
        for session in self.sessions.by_state(T.FENCED):
            session.check_link()
        for session in self.sessions.by_state(T.QUEUED):
            session.keep_alive(now)
        for session in self.sessions.expire(now):
            self.grammars.discard(session.rid)
            session.time_out()

    # ---- helpers ------------------------------------------------------------------------------

    def _moved(self, session: RecvSession) -> None:
        """Follow up a session's new state: one whose KV is complete starts decoding unless its
        grammar still compiles (then :meth:`on_compiled` starts it); one that ended or is
        fenced drops its grammar."""
        if session.state is T.KV_READY:
            session.req.stamps.kv_ready = time.time()
            if not self.grammars.is_pending(session.rid):
                self._start(session)
            return
        self.grammars.discard(session.rid)

    def _start(self, session: RecvSession) -> None:
        """Hand a request whose KV arrived to the scheduler, and report what became of it."""
        req = session.start()
        received = self.scheduler.add_received(req)
        if received is Received.REFUSED:
            self.port.fail(req.rid, req.reply_addr,
                           f"grammar refused first token {req.output_ids[-1]}", 500,
                           FailureKind.GRAMMAR)
        elif received is Received.FINISHED:
            # Normally the prefill worker already saw this end; report it if it did not.
            self.port.emit([(req.reply_addr, token_output(req, req.emitted_len))])

    # ---- what the worker reports ----------------------------------------------------------------

    def held(self) -> dict[str, str]:
        """The scheduler's queued and running requests and those still in a KV handoff (fenced
        ones excepted: their pages wait on the prefill worker, not on the router)."""
        s = self.scheduler
        held = {r.rid: r.reply_addr for r in (*s.waiting, *s.running)}
        held.update((x.rid, x.reply_addr) for x in self.sessions if x.state is not T.FENCED)
        return held

    def step_keepalives(self) -> list[tuple[str, Message]]:
        """None: no peer waits on this worker's steps."""
        return []

    def num_transferring(self) -> int:
        """Requests whose pages are reserved and whose KV is arriving."""
        return len(self.sessions.by_state(T.WAITING_FOR_PAGES))

    def fill_stats(self, stats: WorkerStats) -> WorkerStats:
        """Requests queued for pages count as waiting; the receiver's transfer counters."""
        stats.num_waiting += len(self.sessions.by_state(T.QUEUED))
        return self.receiver.metrics.fill(stats)

    def close(self) -> None:
        """Close the KV receiver (nixl: stop its progress thread; shm: unlink the segment)."""
        self.receiver.close()


DECODE = WorkerRole("decode", computes_prompts=False, decodes=True, receives_kv=True,
                    sends_kv=False, create_policy=DecodePolicy.from_parts)
