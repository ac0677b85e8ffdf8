"""Decode worker: reserves KV pages for each prompt, tells the prefill worker where they are
(``KVBootstrap``), installs the pages when they arrive and decodes with continuous batching
(DESIGN.md, steps 2 and 4).

The handoff of each request is one :class:`~splitserve.kv_transfer.recv_session.RecvSession`
(admission, keepalives, deadlines and the fences of one-sided backends are documented there);
this worker turns messages into that session's events and hands a request whose KV arrived to
the scheduler:

- ``GenerateTask``: open a session (``QUEUED``) and admit in arrival order while
  ``Scheduler.can_admit`` allows: pages reserved, bootstrap sent;
- ``KVPages`` / ``KVKeepalive`` / ``KVFailed`` / ``KVReleased`` / ``AbortTask``: the session's
  events; a session whose KV is complete (``KV_READY``) starts decoding once its grammar, if
  any, has compiled;
- every loop: fenced pages whose prefill worker is gone, queued keepalives, deadlines; and
  admission again whenever pages came back.
"""

from __future__ import annotations

import weakref

from splitserve.config import WorkerConfig
from splitserve.engine.kv_pool import pages_for
from splitserve.engine.sched.batch import StepOutput
from splitserve.engine.sched.request import Req
from splitserve.ipc.frames import Frames
from splitserve.ipc.messages import (
    GenerateTask,
    KVBootstrap,
    KVFailed,
    KVKeepalive,
    KVPages,
    KVReleased,
    Message,
    WorkerStats,
)
from splitserve.kv_transfer.base import layout_to_msg
from splitserve.kv_transfer.recv_session import RecvSession, RecvSessions
from splitserve.kv_transfer.registry import create_kv_receiver
from splitserve.kv_transfer.session import TransferState
from splitserve.worker.base import BaseWorker
from splitserve.worker.grammars import CompileDone

T = TransferState


class DecodeWorker(BaseWorker):
    role = "decode"
    computes_prompts = False  # its prompts' KV arrives; it only recomputes retracted requests
    decodes = True
    receives_kv = True

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.receiver = create_kv_receiver(config.engine.kv_transfer, self.pool)
        # The sessions reach this worker through a weak proxy: no reference cycle keeps a
        # dropped worker (and its sockets) alive.
        port = weakref.proxy(self)
        self.sessions = RecvSessions(port, self.receiver.one_sided, config.addr,
                                     config.engine.transfer_timeout_s, clock=lambda: port.now())

    # ---- the sessions' port (kv_transfer.recv_session.RecvPort); send and fail: BaseWorker ----

    def install(self, header: KVPages, frames: Frames | list) -> None:
        self.receiver.install(header, frames)

    def release(self, req: Req) -> None:
        self.scheduler.free(req)

    def link_drops(self, addr: str) -> int:
        return self.outbox.link_drops(addr)

    # ---- events -------------------------------------------------------------------------------

    def on_generate(self, task: GenerateTask) -> None:
        error = self.check_fits(task)
        if error:
            self.fail(task.rid, task.reply_addr, error, 400)
            return
        if task.prefill_addr is None:
            self.fail(task.rid, task.reply_addr, "a decode worker needs the task's prefill "
                      "worker (prefill_addr); colocated serving is role colocated", 400)
            return
        if task.rid in self.sessions:
            self.fail(task.rid, task.reply_addr, f"request id {task.rid!r} is in use", 400)
            return
        req = self.new_req(task)
        if task.sampling.constraint is not None:
            # Compiles while the pages are reserved and the KV travels.
            self.grammars.submit(req)
        self.sessions.open(req, task.prefill_addr)
        self._admit()

    def _admit(self) -> None:
        """Reserve pages and bootstrap queued requests in arrival order, while pages last."""
        for session in self.sessions.by_state(T.QUEUED):
            n = pages_for(session.req.prompt_len, self.pool.page_size)
            if not self.scheduler.can_admit(n):
                return
            page_ids = self.pool.allocator.alloc(n)
            session.reserve(page_ids, KVBootstrap(
                rid=session.rid,
                dst_addr=self.config.addr,
                page_ids=list(page_ids),
                layout=layout_to_msg(self.pool.layout),
                kv_transfer=self.receiver.name,
                weights=self.weights,
                endpoint=self.receiver.endpoint(),
            ))

    def on_peer_message(self, msg: Message, frames: Frames | list) -> None:
        if not isinstance(msg, (KVPages, KVKeepalive, KVFailed, KVReleased)):
            super().on_peer_message(msg, frames)
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
            session.on_kv_failed(msg.message)
        else:
            session.on_released()
        if session.state is not before:
            self._moved(session)

    def _moved(self, session: RecvSession) -> None:
        """Follow up a session's new state: one whose KV is complete starts decoding unless
        its grammar still compiles (then :meth:`on_grammar_done` starts it); one that ended or
        is fenced drops its grammar, and admission goes on if pages came back."""
        if session.state is T.KV_READY:
            if not self.grammars.is_pending(session.rid):
                self._start_decoding(session.start())
            return
        self.grammars.discard(session.rid)
        if session.state.is_terminal:
            self._admit()

    def _start_decoding(self, req: Req) -> None:
        """Run a request whose KV arrived; a constrained one replays the prefill worker's first
        token into its matcher first (and may jump forward from there)."""
        if req.grammar is not None:
            first = req.output_ids[-1]
            if not req.grammar.accept(first):
                self.scheduler.free(req)
                self.fail(req.rid, req.reply_addr, f"grammar refused first token {first}", 500)
                self._admit()
                return
            if req.check_finished(self.scheduler.eos_token_ids) or self.scheduler.jump_forward(req):
                # Normally the prefill worker already saw this end; report it if it did not.
                self.emit([(req.reply_addr, self.token_output(req, req.emitted_len))])
                self.scheduler.free(req)
                self._admit()
                return
        self.scheduler.add_running(req)

    def on_grammar_done(self, done: CompileDone) -> None:
        session = self.sessions.get(done.req.rid)
        if session is None or session.req is not done.req:
            return  # aborted meanwhile
        if done.error is not None:
            # A request still awaiting its KV: the prefill worker frees its copy now, too.
            session.fail(done.error, notify=True, error=done.error, code=done.code)
            self._moved(session)
        elif session.state is T.KV_READY:
            self._start_decoding(session.start())
        # Otherwise its KV is still on the way; _moved starts it after its last pages.

    def on_step_outputs(self, outputs: list[StepOutput]) -> None:
        self.emit_decoded(outputs)
        if any(out.finished for out in outputs):
            self._admit()

    def on_abort(self, rid: str) -> None:
        # The server aborts both workers; a one-sided transfer is fenced all the same.
        self.grammars.discard(rid)
        if self.sessions.abort(rid) is not None or self.scheduler.abort(rid) is not None:
            self._admit()

    def check_timeouts(self, now: float) -> None:
        fenced = self.sessions.by_state(T.FENCED)
        for session in fenced:
            session.check_link()
        for session in self.sessions.by_state(T.QUEUED):
            session.keep_alive(now)
        expired = self.sessions.expire(now)
        for session in expired:
            self.grammars.discard(session.rid)
            session.time_out()
        if expired or any(s.state.is_terminal for s in fenced):
            self._admit()

    # ---- the shell ------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def num_transferring(self) -> int:
        return len(self.sessions.by_state(T.WAITING_FOR_PAGES))

    def held_requests(self) -> dict[str, str]:
        """The scheduler's requests and those still in a KV handoff (fenced ones excepted:
        their pages wait on the prefill worker, not on the router)."""
        held = super().held_requests()
        held.update((s.rid, s.reply_addr) for s in self.sessions if s.state is not T.FENCED)
        return held

    def close_kv_transfer(self) -> None:
        """Close the KV receiver (nixl: stop its progress thread; shm: unlink the segment)."""
        self.receiver.close()

    def stats(self, query_id: int = 0) -> WorkerStats:
        s = super().stats(query_id)
        s.num_waiting += len(self.sessions.by_state(T.QUEUED))
        return self.receiver.metrics.fill(s)
