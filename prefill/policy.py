"""The prefill role: computes prompts, samples each request's first token, and ships the prompt's
KV pages to the decode worker that reserved room for them (design.md, steps 2-3).

The handoff of each request is one :class:`~splitserve.kv_transfer.send_session.SendSession`
(its states, deadlines, keepalives and acknowledgements are documented there); this policy
turns events into that session's events:

- ``GenerateTask``: open a session (or give the task to the one its bootstrap opened) and
  schedule the request (``worker.prompts``: after its grammar compiled, if constrained);
  ``KVBootstrap``: refuse a layout, weights or backend that are not this worker's, else hand
  it to the session, which acknowledges it and sends what is computed;
- after every step: each bootstrapped session sends its newly completed pages; a request whose
  first token was sampled (``SENDING_KV`` in the scheduler, its pages held) sends the rest, or
  waits for its bootstrap;
- ``KVQueued``, ``KVFailed``, ``AbortTask``: the session's own events; every tick: deadlines,
  keepalives and the backend's progress (``is_done``). A session that ends gives its request
  back to the scheduler, which frees the pages (``worker.port.SessionPort``).
"""

from __future__ import annotations

import logging

from splitserve.engine.kv_pool import KVLayout
from splitserve.engine.sched.batch import StepOutput
from splitserve.engine.sched.request import Req
from splitserve.engine.sched.scheduler import Scheduler
from splitserve.ipc.frames import Frames
from splitserve.ipc.messages import (
    FailureKind,
    GenerateTask,
    KVBootstrap,
    KVFailed,
    KVQueued,
    Message,
    WeightsMsg,
    WorkerStats,
)
from splitserve.ipc.sockets import PeerUnreachable
from splitserve.kv_transfer.base import BaseKVSender, layout_from_msg, weights_mismatch
from splitserve.kv_transfer.send_session import SendSession, SendSessions
from splitserve.kv_transfer.session import TransferState
from splitserve.worker.grammars import CompileDone
from splitserve.worker.outputs import token_output
from splitserve.worker.parts import WorkerParts
from splitserve.worker.port import WorkerPort
from splitserve.worker.prompts import PromptStage
from splitserve.worker.role import WorkerRole

logger = logging.getLogger(__name__)

T = TransferState


class PrefillPolicy:
    """What the prefill worker does with each event (``worker.role.RolePolicy``).

    Args:
        scheduler: the worker's scheduler (``prefill_only``).
        prompts: how tasks reach it.
        sessions: the send sessions, whose port releases through ``scheduler``.
        sender: the KV transfer backend's sender (``sessions``' too).
        port: where tokens and messages go.
        layout: this worker's KV pool layout; ``weights``: its weights' identity;
        kv_transfer: its backend's name. A bootstrap that differs in any is refused.
    """

    def __init__(self, scheduler: Scheduler, prompts: PromptStage, sessions: SendSessions,
                 sender: BaseKVSender, port: WorkerPort, *, layout: KVLayout,
                 weights: WeightsMsg, kv_transfer: str) -> None:
        self.scheduler = scheduler
        self.prompts = prompts
        self.sessions = sessions
        self.sender = sender
        self.port = port
        self.layout = layout
        self.weights = weights
        self.kv_transfer = kv_transfer

    @classmethod
    def from_parts(cls, parts: WorkerParts) -> PrefillPolicy:
        """The policy over a built prefill worker's parts."""
        prompts = PromptStage(parts.scheduler, parts.grammars, parts.port,
                              parts.model_config.context_len)
        return cls(parts.scheduler, prompts, parts.sessions, parts.sender, parts.port,
                   layout=parts.pool.layout, weights=parts.weights,
                   kv_transfer=parts.config.engine.kv_transfer)

    # ---- events -------------------------------------------------------------------------------

    def on_task(self, task: GenerateTask) -> None:
        """Open the request's session (or give it the task) and schedule the request."""
        session = self.sessions.get(task.rid)
        req = self.prompts.accept(task)
        if req is None:
            if session is not None:
                session.abort()
            return
        if session is None:
            session = self.sessions.open_task(req)
        else:
            session.on_task(req)
        if session.req is not req:
            return  # it failed already (the decode worker gave up): the late task is dropped
        if session.bootstrap is not None and session.bootstrap.lora != req.lora_id:
            self._refuse(session.bootstrap, session, adapter_mismatch(req.lora_id,
                                                                      session.bootstrap.lora))
            return
        self.prompts.start(req)

    def on_compiled(self, done: CompileDone) -> None:
        """Schedule a compiled request; fail one whose constraint did not compile (the decode
        side's reserved pages are freed now too)."""
        session = self.sessions.get(done.req.rid)
        if session is None or session.req is not done.req:
            return  # aborted while compiling
        if not self.prompts.compiled(done):
            session.fail(done.error, done.code, notify=done.error, kind=FailureKind.GRAMMAR)

    def on_peer(self, msg: Message, frames: Frames | list) -> None:
        """The decode worker's handoff messages: ``KVBootstrap``, ``KVQueued``, ``KVFailed``."""
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
            logger.warning("prefill worker ignores %s", type(msg).__name__)

    def _on_bootstrap(self, boot: KVBootstrap) -> None:
        session = self.sessions.get(boot.rid)
        mismatches = [
            self.layout.mismatch(layout_from_msg(boot.layout)),
            weights_mismatch(self.weights, boot.weights),
        ]
        if boot.kv_transfer != self.kv_transfer:
            mismatches = [(f"KV transfer backend mismatch: {self.kv_transfer!r} here vs "
                           f"{boot.kv_transfer!r} on the decode worker")]
        if session is not None and session.req is not None and session.req.lora_id != boot.lora:
            mismatches.append(adapter_mismatch(session.req.lora_id, boot.lora))
        mismatch = "; ".join(m for m in mismatches if m)
        if mismatch:
            self._refuse(boot, session, mismatch)
        elif session is None:
            self.sessions.open_bootstrap(boot)
        else:
            session.on_bootstrap(boot)

    def _refuse(self, boot: KVBootstrap, session: SendSession | None, mismatch: str) -> None:
        """Refuse ``boot``: the decode worker frees its reservation, the session fails."""
        message = f"refused by prefill worker: {mismatch}"
        try:
            self.port.send(boot.dst_addr, KVFailed(boot.rid, message))
        except PeerUnreachable as exc:
            logger.warning("could not refuse the bootstrap of %s: %s", boot.rid, exc)
        if session is not None:
            session.fail(message)

    def on_admitted(self, reqs: list[Req]) -> None:
        """Nothing: no request here waits for KV."""

    def on_step(self, outputs: list[StepOutput]) -> None:
        """Send the pages the step completed; hand each prefilled request to its session."""
        for session in self.sessions.by_state(T.TRANSFERRING):
            session.send_computed_pages()
        prefilled = []
        for out in outputs:
            session = self.sessions.get(out.req.rid)
            if session is None or session.req is not out.req:  # aborted meanwhile
                self.scheduler.release(out.req)
            else:
                prefilled.append(session)
        # The first tokens go out before the last pages.
        self.port.emit([(s.reply_addr, token_output(s.req, 0)) for s in prefilled])
        for session in prefilled:
            session.on_prefilled()

    def on_abort(self, rid: str) -> None:
        """The router aborted ``rid``: its session stops and frees what is not being read."""
        self.sessions.abort(rid)

    def on_tick(self, now: float) -> None:
        """The backend's progress, drained sends, deadlines and keepalives."""
        self.sender.poll()
        for session in self.sessions.by_state(T.DRAINING, T.RELEASING):
            session.poll()
        for session in self.sessions.expire(now):
            session.time_out()
        for session in self.sessions.by_state(T.WAITING_FOR_TASK, T.TRANSFERRING):
            session.keep_alive(now)

    def step_keepalives(self) -> list[tuple[str, Message]]:
        """A ``KVKeepalive`` for each bootstrapped request still computing here."""
        found = (s.step_keepalive() for s in self.sessions.by_state(T.WAITING_FOR_TASK,
                                                                    T.TRANSFERRING))
        return [m for m in found if m is not None]

    # ---- what the worker reports ----------------------------------------------------------------

    def held(self) -> dict[str, str]:
        """The scheduler's queued requests and the sessions whose task came (a bootstrap alone
        names no router; a drained one answers to nobody)."""
        s = self.scheduler
        held = {r.rid: r.reply_addr for r in (*s.waiting, *s.running)}
        held.update((x.rid, x.reply_addr) for x in self.sessions
                    if x.reply_addr and x.state not in (T.DRAINING, T.RELEASING))
        return held

    def num_transferring(self) -> int:
        """Prefilled requests whose KV is still to send or being read."""
        return len(self.sessions.by_state(T.PREFILLED, T.DRAINING))

    def fill_stats(self, stats: WorkerStats) -> WorkerStats:
        """The sender's transfer counters."""
        return self.sender.metrics.fill(stats)

    def close(self) -> None:
        """Close the KV sender (one-sided backends: stop the writer thread after its queue)."""
        self.sender.close()


def adapter_mismatch(here: str, there: str) -> str:
    """Why a request's KV may not cross: its LoRA adapter (digests; "" the base model) differs
    between this prefill worker and the decode worker."""
    return (f"LoRA adapter mismatch: {here or 'base model'} here vs {there or 'base model'} "
            "on the decode worker (their adapter files differ)")


PREFILL = WorkerRole("prefill", computes_prompts=True, decodes=False, receives_kv=False,
                     sends_kv=True, create_policy=PrefillPolicy.from_parts)
