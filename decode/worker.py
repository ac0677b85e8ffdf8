"""Decode worker: reserves KV pages for each prompt, tells the prefill worker where they are
(``KVBootstrap``), installs the pages when they arrive and decodes with continuous batching
(DESIGN.md, steps 2 and 4).

Admission control: a request is
bootstrapped only when its prompt's pages can be reserved; until then it waits in a queue, and
tells the prefill worker so (``KVQueued``) every third of ``transfer_timeout``: each message
that goes out restarts the request's deadline there and here, so only a prefill worker that is
unreachable or whose link dropped (it lost the prompt's KV) times a queued request out. Every
state has a deadline; on expiry the request fails and its pages are freed. With a
one-sided backend (shm, mooncake, nixl) the pages of a request that failed before its KV fully arrived
are freed only once the prefill worker acknowledges that it stopped writing them
(``decode.fences``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from splitserve.decode.fences import Fence, KVFences
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
from splitserve.kv_transfer.base import layout_to_msg
from splitserve.kv_transfer.registry import create_kv_receiver
from splitserve.worker.base import BaseWorker
from splitserve.worker.grammars import CompileDone

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingKV:
    """A request waiting for pages to reserve, then for its KV to arrive."""

    req: Req
    prefill_addr: str
    deadline: float
    bootstrapped: bool = False
    reserved: frozenset[int] = frozenset()  # req.page_ids once bootstrapped (checks each message)
    link_drops: int = 0  # drops of the link to the prefill worker when queued, then when bootstrapped
    last_keepalive: float = 0.0  # when the last KVQueued went out (time.monotonic())


class DecodeWorker(BaseWorker):
    role = "decode"
    computes_prompts = False  # its prompts' KV arrives; it only recomputes retracted requests
    decodes = True
    receives_kv = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.receiver = create_kv_receiver(config.engine.kv_transfer, self.pool)
        self.admission: deque[PendingKV] = deque()  # waiting for pages to reserve
        self.awaiting_kv: dict[str, PendingKV] = {}  # bootstrapped, waiting for KVPages
        self.fences = KVFences()  # failed requests whose pages the prefill side may still write
        # Constrained requests whose KV already arrived while their grammar still compiles
        # (they start decoding once the compile is done).
        self.kv_ready: dict[str, Req] = {}

    def on_generate(self, task: GenerateTask) -> None:
        error = self.check_fits(task)
        if error:
            self.fail(task.rid, task.reply_addr, error, 400)
            return
        if task.prefill_addr is None:
            self.fail(task.rid, task.reply_addr, "a decode worker needs the task's prefill "
                      "worker (prefill_addr); colocated serving is role colocated", 400)
            return
        req = self.new_req(task)
        if task.sampling.constraint is not None:
            # Compiles while the pages are reserved and the KV travels.
            self.grammars.submit(req)
        now = time.monotonic()
        pending = PendingKV(req, task.prefill_addr, now + self.config.engine.transfer_timeout_s)
        pending.last_keepalive = now
        pending.link_drops = self.outbox.link_drops(task.prefill_addr)
        self.admission.append(pending)
        self._admit()

    def _admit(self) -> None:
        """Reserve pages and bootstrap queued requests in arrival order, while pages last."""
        alloc = self.pool.allocator
        while self.admission:
            pending = self.admission[0]
            n = pages_for(pending.req.prompt_len, self.pool.page_size)
            if not self.scheduler.can_admit(n):
                return
            self.admission.popleft()
            req = pending.req
            req.page_ids = alloc.alloc(n)
            pending.bootstrapped = True
            pending.reserved = frozenset(req.page_ids)
            pending.link_drops = self.outbox.link_drops(pending.prefill_addr)
            self.awaiting_kv[req.rid] = pending
            boot = KVBootstrap(
                rid=req.rid,
                dst_addr=self.config.addr,
                page_ids=list(req.page_ids),
                layout=layout_to_msg(self.pool.layout),
                kv_transfer=self.receiver.name,
                endpoint=self.receiver.endpoint(),
            )
            self.send(pending.prefill_addr, boot)

    def on_peer_message(self, msg: Message, frames: Frames | list) -> None:
        if isinstance(msg, KVPages):
            self._on_kv_pages(msg, frames)
        elif isinstance(msg, KVFailed):
            pending = self.awaiting_kv.pop(msg.rid, None)
            if pending is not None:
                self.grammars.discard(msg.rid)
                self._end_transfer(pending, msg.message, notify=False)
                self.fail(msg.rid, pending.req.reply_addr, msg.message, 500)
                self._admit()
        elif isinstance(msg, KVReleased):
            released = self.fences.release(msg.rid)
            for req in released:
                self.scheduler.free(req)
            if released:
                self._admit()
        else:
            super().on_peer_message(msg, frames)

    def _on_kv_pages(self, header: KVPages, frames: Frames | list) -> None:
        pending = self.awaiting_kv.get(header.rid)
        if pending is None:
            return  # aborted or timed out: its pages are already free
        # A stall is silence from the prefill worker, not a long queue there: every message
        # (pages or the keepalive it sends while the request waits) restarts the timer.
        pending.deadline = time.monotonic() + self.config.engine.transfer_timeout_s
        if not header.page_ids and not header.last:
            return  # keepalive
        req = pending.req
        try:
            # Checked before the receiver writes anything into the pool.
            if not pending.reserved.issuperset(header.page_ids):
                raise ValueError("pages outside the request's reservation")
            self.receiver.install(header, frames)
        except ValueError as exc:
            del self.awaiting_kv[header.rid]
            self.grammars.discard(req.rid)
            self._end_transfer(pending, f"decode worker: KV transfer failed: {exc}")
            self.fail(req.rid, req.reply_addr, f"KV transfer failed: {exc}", 500)
            self._admit()
            return
        if not header.last:
            return
        del self.awaiting_kv[header.rid]
        if header.finished:  # the first token ended it; the prefill worker reported it
            self.grammars.discard(req.rid)
            self.scheduler.free(req)
            self._admit()
            return
        req.output_ids.append(header.first_token)
        req.output_logprobs.append(header.first_logprob)
        req.kv_len = req.prompt_len
        req.emitted_len = 1
        if self.grammars.is_pending(req.rid):
            self.kv_ready[req.rid] = req
            return
        self._start_decoding(req)

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
        req = done.req
        if done.error is not None:
            self._fail_compile(req, done.error, done.code)
        elif self.kv_ready.pop(req.rid, None) is not None:
            self._start_decoding(req)
        # Otherwise its KV is still on the way; _on_kv_pages starts it.

    def _fail_compile(self, req: Req, message: str, code: int) -> None:
        # A request still awaiting its KV: the prefill worker frees its copy now, too.
        self._abort(req.rid, message, notify=True)
        self.fail(req.rid, req.reply_addr, message, code)

    def on_step_outputs(self, outputs: list[StepOutput]) -> None:
        self.emit_decoded(outputs)
        if any(out.finished for out in outputs):
            self._admit()

    def on_abort(self, rid: str) -> None:
        # The server aborts both workers; a one-sided transfer is fenced all the same.
        self._abort(rid, "aborted", notify=False)

    def _abort(self, rid: str, message: str, notify: bool) -> None:
        """End ``rid`` wherever it is here (``message``, ``notify``: see :meth:`_end_transfer`)."""
        self.grammars.discard(rid)
        ready = self.kv_ready.pop(rid, None)
        if ready is not None:  # its pages are installed
            self.scheduler.free(ready)
            self._admit()
            return
        if self.scheduler.abort(rid) is not None:
            self._admit()
            return
        pending = self.awaiting_kv.pop(rid, None)
        if pending is not None:
            self._end_transfer(pending, message, notify)
            self._admit()
            return
        for pending in self.admission:
            if pending.req.rid == rid:
                self.admission.remove(pending)
                return

    def _end_transfer(self, pending: PendingKV, message: str, notify: bool = True) -> None:
        """Free the reserved pages of a request whose KV did not fully arrive.

        ``notify``: tell the prefill worker (``KVFailed``), so it stops computing and sending
        now rather than at its own deadline. A one-sided backend always tells it and asks for
        an acknowledgement; the pages stay fenced until it comes (``decode.fences``).
        """
        req, one_sided = pending.req, self.receiver.one_sided
        if notify or one_sided:
            ack_addr = self.config.addr if one_sided else ""
            try:
                self.send(pending.prefill_addr, KVFailed(req.rid, message, ack_addr))
            except PeerUnreachable as exc:  # then only the fence's deadline frees the pages
                logger.warning("could not tell the prefill worker about %s: %s", req.rid, exc)
        if one_sided:
            deadline = time.monotonic() + self.config.engine.transfer_timeout_s
            self.fences.add(Fence(req, pending.prefill_addr, deadline, pending.link_drops))
        else:
            self.scheduler.free(req)

    def _check_fences(self, now: float) -> None:
        """Free fenced pages whose prefill worker is gone or that waited out the timeout."""
        drops = {addr: self.outbox.link_drops(addr) for addr in self.fences.peers()}
        gone = self.fences.pop_where(lambda f: drops[f.prefill_addr] > f.link_drops)
        for fence in gone:
            logger.info("prefill worker %s is gone (link dropped): freeing the %d fenced pages "
                        "of %s", fence.prefill_addr, len(fence.req.page_ids), fence.req.rid)
        expired = self.fences.pop_where(lambda f: f.deadline < now)
        for fence in expired:
            logger.warning("no KVReleased from prefill worker %s for %s within %g s: freeing "
                           "its %d pages", fence.prefill_addr, fence.req.rid,
                           self.config.engine.transfer_timeout_s, len(fence.req.page_ids))
        for fence in gone + expired:
            self.scheduler.free(fence.req)
        if gone or expired:
            self._admit()

    def check_timeouts(self, now: float) -> None:
        if len(self.fences):
            self._check_fences(now)
        if self.admission:
            self._keep_queued_alive(now)
        expired = [p for p in self.awaiting_kv.values() if p.deadline < now]
        expired += [p for p in self.admission if p.deadline < now]
        for pending in expired:
            rid = pending.req.rid
            stage = "receiving KV pages" if pending.bootstrapped else "reserving KV pages"
            # Tell the prefill side too, so it frees its copy now rather than at its deadline.
            self._abort(rid, "decode worker timed out", notify=True)
            self.fail(
                rid, pending.req.reply_addr,
                f"KV transfer timed out {stage} after {self.config.engine.transfer_timeout_s:g} s", 504,
            )

    def _keep_queued_alive(self, now: float) -> None:
        """Tell each queued request's prefill worker it still waits here (``KVQueued``)."""
        interval = self.config.engine.transfer_timeout_s / 3
        for pending in self.admission:
            if now - pending.last_keepalive < interval:
                continue
            if self.outbox.link_drops(pending.prefill_addr) > pending.link_drops:
                continue  # the prefill worker restarted or left: the deadline runs out
            pending.last_keepalive = now
            try:
                self.send(pending.prefill_addr, KVQueued(pending.req.rid))
            except PeerUnreachable as exc:  # its deadline runs on
                logger.warning("queued keepalive for %s not delivered: %s", pending.req.rid, exc)
                continue
            pending.deadline = now + self.config.engine.transfer_timeout_s

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def num_transferring(self) -> int:
        return len(self.awaiting_kv)

    def close_kv_transfer(self) -> None:
        """Close the KV receiver (nixl: stop its progress thread; shm: unlink the segment)."""
        self.receiver.close()

    def stats(self, query_id: int = 0) -> WorkerStats:
        s = super().stats(query_id)
        s.num_waiting += len(self.admission)
        return self.receiver.metrics.fill(s)
