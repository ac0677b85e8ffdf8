"""Prefill worker: computes prompts, samples each request's first token, and ships the prompt's KV
pages to the decode worker that reserved room for them (DESIGN.md, steps 2-3).

The handoff of each request is one :class:`~splitserve.kv_transfer.send_session.SendSession`
(its states, deadlines, keepalives and acknowledgements are documented there); this worker
turns messages and scheduler outputs into that session's events:

- ``GenerateTask``: open a session (or give the task to the one its bootstrap opened) and
  schedule the request; ``KVBootstrap``: refuse a layout or backend that is not this worker's,
  else hand it to the session, which acknowledges it and sends what is computed;
- after every step: each bootstrapped session sends its newly completed pages; a request whose
  first token was sampled sends the rest (or waits for its bootstrap);
- ``KVQueued``, ``KVFailed``, ``AbortTask``: the session's own events; every loop: deadlines,
  keepalives and the backend's progress (``is_done``).
"""

from __future__ import annotations

import logging
import weakref

from splitserve.config import WorkerConfig
from splitserve.engine.sched.batch import StepOutput
from splitserve.engine.sched.request import Req
from splitserve.ipc.frames import Frames
from splitserve.ipc.messages import (
    GenerateTask,
    KVBootstrap,
    KVFailed,
    KVQueued,
    Message,
    WorkerStats,
)
from splitserve.ipc.sockets import PeerUnreachable
from splitserve.kv_transfer.base import layout_from_msg, weights_mismatch
from splitserve.kv_transfer.registry import create_kv_sender
from splitserve.kv_transfer.send_session import SendSessions
from splitserve.kv_transfer.session import TransferState
from splitserve.worker.base import BaseWorker
from splitserve.worker.grammars import CompileDone

logger = logging.getLogger(__name__)

T = TransferState


class PrefillWorker(BaseWorker):
    role = "prefill"
    computes_prompts = True
    decodes = False  # a request leaves with its first token, for the decode worker
    receives_kv = False

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.sender = create_kv_sender(config.engine.kv_transfer, self.pool, self.outbox)
        # The sessions reach this worker through a weak proxy: no reference cycle keeps a
        # dropped worker (and its sockets) alive.
        port = weakref.proxy(self)
        self.sessions = SendSessions(self.sender, port, self.pool.page_size,
                                     config.engine.transfer_timeout_s, clock=lambda: port.now())

    # ---- the sessions' port (kv_transfer.send_session.SendPort); send and fail: BaseWorker ----

    def release(self, req: Req) -> None:
        """Give back all ``req`` holds: its compile, its place in the scheduler, its pages."""
        self.grammars.discard(req.rid)
        if self.scheduler.abort(req.rid) is None:  # prefilled (or compiling): not queued
            self.scheduler.free(req)

    # ---- events -------------------------------------------------------------------------------

    def on_generate(self, task: GenerateTask) -> None:
        session = self.sessions.get(task.rid)
        error = self.check_fits(task)
        if error:
            if session is not None:
                session.abort()
            self.fail(task.rid, task.reply_addr, error, 400)
            return
        req = self.new_req(task)
        if session is None:
            session = self.sessions.open_task(req)
        else:
            session.on_task(req)
        if session.req is not req:
            return  # it failed already (the decode worker gave up): the late task is dropped
        if task.sampling.constraint is not None:
            self.grammars.submit(req)  # joins the scheduler in on_grammar_done
        else:
            self.scheduler.add(req)

    def on_grammar_done(self, done: CompileDone) -> None:
        session = self.sessions.get(done.req.rid)
        if session is None or session.req is not done.req:
            return  # aborted while compiling
        if done.error is None:
            self.scheduler.add(done.req)
        else:  # the decode side's reserved pages are freed now too
            session.fail(done.error, done.code, notify=done.error)

    def on_peer_message(self, msg: Message, frames: Frames | list) -> None:
        if isinstance(msg, KVFailed):  # the decode side gave up; it has told the server
            session = self.sessions.get(msg.rid)
            if session is not None:
                session.on_kv_failed(msg.ack_addr)
            elif msg.ack_addr:
                self.sessions.open_release(msg.rid, msg.ack_addr)
        elif isinstance(msg, KVQueued):  # still queued at decode: not a stall, keep waiting
            session = self.sessions.get(msg.rid)
            if session is not None:
                session.on_queued()
        elif isinstance(msg, KVBootstrap):
            self._on_bootstrap(msg)
        else:
            super().on_peer_message(msg, frames)

    def _on_bootstrap(self, boot: KVBootstrap) -> None:
        session = self.sessions.get(boot.rid)
        mismatches = [
            self.pool.layout.mismatch(layout_from_msg(boot.layout)),
            weights_mismatch(self.weights, boot.weights),
        ]
        if boot.kv_transfer != self.config.engine.kv_transfer:
            backend = self.config.engine.kv_transfer
            wrong = f"KV transfer backend mismatch: {backend!r} here vs {boot.kv_transfer!r}"
            mismatches = [wrong + " on the decode worker"]
        mismatch = "; ".join(m for m in mismatches if m)
        if mismatch:
            message = f"refused by prefill worker: {mismatch}"
            try:
                self.send(boot.dst_addr, KVFailed(boot.rid, message))
            except PeerUnreachable as exc:
                logger.warning("could not refuse the bootstrap of %s: %s", boot.rid, exc)
            if session is not None:
                session.fail(message)
        elif session is None:
            self.sessions.open_bootstrap(boot)
        else:
            session.on_bootstrap(boot)

    def on_step_outputs(self, outputs: list[StepOutput]) -> None:
        for session in self.sessions.by_state(T.TRANSFERRING):
            session.send_computed_pages()
        prefilled = []
        for out in outputs:
            session = self.sessions.get(out.req.rid)
            if session is None or session.req is not out.req:  # aborted meanwhile
                self.scheduler.free(out.req)
            else:
                prefilled.append(session)
        # The first tokens go out before the last pages.
        self.emit([(s.reply_addr, self.token_output(s.req, 0)) for s in prefilled])
        for session in prefilled:
            session.on_prefilled()

    def on_abort(self, rid: str) -> None:
        self.sessions.abort(rid)

    def check_timeouts(self, now: float) -> None:
        self.sender.poll()
        for session in self.sessions.by_state(T.DRAINING, T.RELEASING):
            session.poll()
        for session in self.sessions.expire(now):
            session.time_out()
        for session in self.sessions.by_state(T.WAITING_FOR_TASK, T.TRANSFERRING):
            session.keep_alive(now)

    # ---- the shell ------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work  # draining is checked every loop, no need to spin

    def num_transferring(self) -> int:
        return len(self.sessions.by_state(T.PREFILLED, T.DRAINING))

    def held_requests(self) -> dict[str, str]:
        """The scheduler's requests and the sessions whose task came (a bootstrap alone
        names no router)."""
        held = super().held_requests()
        held.update((s.rid, s.reply_addr) for s in self.sessions
                    if s.reply_addr and s.state not in (T.DRAINING, T.RELEASING))
        return held

    def close_kv_transfer(self) -> None:
        """Close the KV sender (one-sided backends: stop the writer thread after its queue)."""
        self.sender.close()

    def stats(self, query_id: int = 0) -> WorkerStats:
        return self.sender.metrics.fill(super().stats(query_id))
