"""Prefill worker: computes prompts, samples each request's first token, and ships the prompt's KV
pages to the decode worker that reserved room for them (DESIGN.md, steps 2-3).

Prefill starts as soon as the task arrives; the decode worker's ``KVBootstrap`` (where the pages
go) may come before or after. A request whose bootstrap does not come within
``transfer_timeout_s`` fails and its pages are freed; each ``KVQueued`` (the decode worker has
no room yet and is still waiting for it) restarts that timer.

Overlap: after every scheduler step, each bootstrapped request's newly completed pages are sent
at once (``KVPages`` with ``last=False``), so when the first token is sampled only the last
piece is still to go. After the last send the pages wait in ``draining`` until the backend no
longer reads them (zmq sends straight from the pool), at most ``transfer_timeout_s``.

A decode worker that gives up on a request sends ``KVFailed``; with a one-sided backend it also
names an ``ack_addr`` and keeps the request's pages fenced until this worker answers
``KVReleased``: sent once the request is dropped here and no write of it is in flight.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from splitserve.engine.kv_pool import pages_for
from splitserve.engine.sched.batch import StepOutput
from splitserve.engine.sched.request import Req
from splitserve.ipc.frames import Frames
from splitserve.ipc.messages import (
    GenerateTask,
    KVBootstrap,
    KVFailed,
    KVPages,
    KVQueued,
    KVReleased,
    Message,
    WorkerStats,
)
from splitserve.ipc.sockets import PeerUnreachable
from splitserve.kv_transfer.base import layout_from_msg
from splitserve.kv_transfer.registry import create_kv_sender
from splitserve.worker.base import BaseWorker
from splitserve.worker.grammars import CompileDone

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Transfer:
    """A request between task arrival and the end of its KV send."""

    rid: str
    reply_addr: str
    deadline: float
    req: Req | None = None  # set once the task arrived
    prefilled: bool = False  # first token sampled; pages now owned by this transfer
    bootstrap: KVBootstrap | None = None
    num_pages_sent: int = 0  # leading prompt pages already shipped (early chunks)
    last_progress: float = 0.0  # when the decode worker last heard of this request


@dataclass(slots=True)
class Draining:
    """Pages of a sent request that the backend may still be reading."""

    req: Req
    dst_addr: str
    deadline: float


class PrefillWorker(BaseWorker):
    role = "prefill"
    computes_prompts = True
    decodes = False  # a request leaves with its first token, for the decode worker
    receives_kv = False

    def __init__(self, config) -> None:
        super().__init__(config)
        self.sender = create_kv_sender(config.engine.kv_transfer, self.pool, self.outbox)
        self.transfers: dict[str, Transfer] = {}
        self.draining: dict[str, Draining] = {}
        # rid -> (ack_addr, deadline): KVReleased owed once no write of rid is in flight.
        self.acks_owed: dict[str, tuple[str, float]] = {}

    def _transfer(self, rid: str, reply_addr: str = "") -> Transfer:
        t = self.transfers.get(rid)
        if t is None:
            t = Transfer(rid, reply_addr, time.monotonic() + self.config.engine.transfer_timeout_s)
            self.transfers[rid] = t
        return t

    def on_generate(self, task: GenerateTask) -> None:
        error = self.check_fits(task)
        if error:
            self.transfers.pop(task.rid, None)
            self.fail(task.rid, task.reply_addr, error, 400)
            return
        t = self._transfer(task.rid, task.reply_addr)
        t.reply_addr = task.reply_addr
        t.req = self.new_req(task)
        if task.sampling.constraint is not None:
            self.grammars.submit(t.req)  # joins the scheduler in on_grammar_done
        else:
            self.scheduler.add(t.req)

    def on_grammar_done(self, done: CompileDone) -> None:
        t = self.transfers.get(done.req.rid)
        if t is None or t.req is not done.req:
            return  # aborted while compiling
        if done.error is None:
            self.scheduler.add(done.req)
            return
        self._drop(t, done.error, done.code)  # first, so the client gets this error
        if t.bootstrap is not None:  # free the decode side's reserved pages now
            try:
                self.send(t.bootstrap.dst_addr, KVFailed(t.rid, done.error))
            except PeerUnreachable as exc:
                logger.warning("could not tell the decode worker about %s: %s", t.rid, exc)

    def on_peer_message(self, msg: Message, frames: Frames | list) -> None:
        if isinstance(msg, KVFailed):  # the decode side gave up; it has told the server
            self.on_abort(msg.rid)
            if msg.ack_addr:
                deadline = time.monotonic() + self.config.engine.transfer_timeout_s
                self.acks_owed[msg.rid] = (msg.ack_addr, deadline)
                self._send_acks(time.monotonic())
            return
        if isinstance(msg, KVQueued):  # still queued at decode: not a stall, keep waiting
            t = self.transfers.get(msg.rid)
            if t is not None and t.bootstrap is None:
                t.deadline = time.monotonic() + self.config.engine.transfer_timeout_s
            return
        if not isinstance(msg, KVBootstrap):
            return super().on_peer_message(msg, frames)
        t = self._transfer(msg.rid)
        mismatch = self.pool.layout.mismatch(layout_from_msg(msg.layout))
        if msg.kv_transfer != self.config.engine.kv_transfer:
            mismatch = (f"KV transfer backend mismatch: {self.config.engine.kv_transfer!r} here vs "
                        f"{msg.kv_transfer!r} on the decode worker")
        if mismatch:
            self.send(msg.dst_addr, KVFailed(msg.rid, f"refused by prefill worker: {mismatch}"))
            self._drop(t, f"refused by prefill worker: {mismatch}")
            return
        t.bootstrap = msg
        self._keepalive(t, time.monotonic())  # the ack: decode now waits on our progress
        self._maybe_send(t)

    def _keepalive(self, t: Transfer, now: float) -> None:
        """An empty ``KVPages``: the request is alive here (queued or computing). The decode
        worker's stall timer restarts on every message, so a long prefill queue is not a stall,
        while a prefill worker that dies or hangs still times out there."""
        try:
            self.send(t.bootstrap.dst_addr, KVPages(rid=t.rid, page_ids=[], num_frames=0, last=False))
        except PeerUnreachable as exc:
            logger.warning("keepalive for %s not delivered: %s", t.rid, exc)
        t.last_progress = now

    def on_step_outputs(self, outputs: list[StepOutput]) -> None:
        self._send_early_pages()
        emitted = []
        for out in outputs:
            t = self.transfers.get(out.req.rid)
            if t is None:  # aborted meanwhile
                self.scheduler.free(out.req)
                continue
            t.prefilled = True
            emitted.append((out.req.reply_addr, self.token_output(out.req, 0)))
        self.emit(emitted)
        for out in outputs:
            t = self.transfers.get(out.req.rid)
            if t is not None:
                self._maybe_send(t)

    def _send_early_pages(self) -> None:
        """Ship the complete pages that chunked prefill produced since the last step."""
        for t in list(self.transfers.values()):
            if t.prefilled or t.bootstrap is None or t.req is None:
                continue
            complete = min(t.req.kv_len, t.req.prompt_len) // self.pool.page_size
            if complete > t.num_pages_sent:
                self._send_pages(t, complete, last=False)

    def _send_pages(self, t: Transfer, end: int, last: bool) -> bool:
        """Send prompt pages ``[t.num_pages_sent, end)``; False (request dropped) on failure."""
        req, boot = t.req, t.bootstrap
        start = t.num_pages_sent
        try:
            if len(boot.page_ids) < end:
                raise ValueError(f"decode reserved {len(boot.page_ids)} pages, prompt needs {end}")
            self.sender.send(
                boot, req.page_ids[start:end], boot.page_ids[start:end], last=last,
                first_token=req.output_ids[0] if last else -1,
                first_logprob=req.output_logprobs[0] if last else 0.0,
                finished=last and req.finish_reason is not None,
            )
        except (PeerUnreachable, ValueError) as exc:
            self._drop(t, f"KV transfer failed: {exc}")
            try:  # let the decode worker free its reservation now rather than at its deadline
                self.send(boot.dst_addr, KVFailed(req.rid, f"prefill worker: KV transfer failed: {exc}"))
            except PeerUnreachable:
                pass
            return False
        t.num_pages_sent = end
        t.last_progress = time.monotonic()
        return True

    def _maybe_send(self, t: Transfer) -> None:
        if not (t.bootstrap and t.req):
            return
        req = t.req
        if not t.prefilled:
            complete = min(req.kv_len, req.prompt_len) // self.pool.page_size
            if complete > t.num_pages_sent:
                self._send_pages(t, complete, last=False)
            return
        # A request that ended with its first token needs no more pages (the decode side frees
        # the ones it got).
        n = t.num_pages_sent if req.finish_reason else pages_for(req.prompt_len, self.pool.page_size)
        if not self._send_pages(t, n, last=True):
            return
        del self.transfers[req.rid]
        self._release(req, t.bootstrap.dst_addr)

    def _release(self, req: Req, dst_addr: str) -> None:
        """Free ``req``'s pages once the backend is done reading them."""
        if self.sender.is_done(req.rid):
            self.scheduler.free(req)
        else:
            deadline = time.monotonic() + self.config.engine.transfer_timeout_s
            self.draining[req.rid] = Draining(req, dst_addr, deadline)

    def _check_draining(self, now: float) -> None:
        for rid, d in list(self.draining.items()):
            if d.deadline < now:
                logger.warning("KV send of %s to %s not done after %g s: dropping what is queued",
                               rid, d.dst_addr, self.config.engine.transfer_timeout_s)
                self.sender.cancel_peer(d.dst_addr)
            elif not self.sender.is_done(rid):
                continue
            del self.draining[rid]
            self.scheduler.free(d.req)

    def _send_acks(self, now: float) -> None:
        """Answer ``KVReleased`` for each owed rid that has no write in flight any more."""
        for rid, (addr, deadline) in list(self.acks_owed.items()):
            if self.sender.is_done(rid):
                del self.acks_owed[rid]
                try:
                    self.send(addr, KVReleased(rid))
                except PeerUnreachable as exc:  # the decode worker frees at its own deadline
                    logger.warning("KVReleased for %s not delivered: %s", rid, exc)
            elif deadline < now:  # a write that never ends: the decode side's deadline rules
                logger.warning("KV writes of %s still in flight after %g s; not acknowledging",
                               rid, self.config.engine.transfer_timeout_s)
                del self.acks_owed[rid]

    def on_abort(self, rid: str) -> None:
        # Pages of early chunks may still be queued in the backend: freeing them now is safe
        # (the pool outlives every send; at worst stale bytes reach a request that is gone), and
        # a finished request in ``draining`` keeps its pages until the backend is done. Writes
        # not yet started are skipped (one-sided backends).
        self.sender.cancel(rid)
        self.grammars.discard(rid)
        t = self.transfers.pop(rid, None)
        if t is not None and t.req is not None and self.scheduler.abort(rid) is None:
            self.scheduler.free(t.req)

    def _drop(self, t: Transfer, message: str, code: int = 500) -> None:
        self.on_abort(t.rid)
        self.transfers.pop(t.rid, None)
        if t.reply_addr:
            self.fail(t.rid, t.reply_addr, message, code)

    def check_timeouts(self, now: float) -> None:
        self.sender.poll()
        if self.draining:
            self._check_draining(now)
        if self.acks_owed:
            self._send_acks(now)
        for t in [t for t in self.transfers.values() if t.deadline < now]:
            if t.req is None:
                # A bootstrap whose task never came (the task failed validation or was aborted).
                self.transfers.pop(t.rid, None)
            elif t.bootstrap is None:
                self._drop(t, f"KV transfer timed out: no decode worker bootstrap within "
                              f"{self.config.engine.transfer_timeout_s:g} s")
        interval = self.config.engine.transfer_timeout_s / 3
        for t in list(self.transfers.values()):
            if t.bootstrap is not None and not t.prefilled and now - t.last_progress > interval:
                self._keepalive(t, now)

    def has_work(self) -> bool:
        return self.scheduler.has_work  # draining is checked every loop, no need to spin

    def num_transferring(self) -> int:
        return sum(1 for t in self.transfers.values() if t.prefilled) + len(self.draining)

    def close_kv_transfer(self) -> None:
        """Close the KV sender (one-sided backends: stop the writer thread after its queue)."""
        self.sender.close()

    def stats(self, query_id: int = 0) -> WorkerStats:
        return self.sender.metrics.fill(super().stats(query_id))
