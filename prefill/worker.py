"""Prefill worker: computes prompts, samples each request's first token, and ships the prompt's KV
pages to the decode worker that reserved room for them (DESIGN.md, steps 2-3).

Prefill starts as soon as the task arrives; the decode worker's ``KVBootstrap`` (where the pages
go) may come before or after. A request whose bootstrap does not come within
``transfer_timeout_s`` fails and its pages are freed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from splitserve.engine.grammar.worker_grammars import CompileDone
from splitserve.engine.kv_pool import pages_for
from splitserve.engine.request import Req
from splitserve.engine.scheduler import StepOutput
from splitserve.engine.worker_base import BaseWorker
from splitserve.ipc import PeerUnreachable
from splitserve.kv_transfer.base import layout_from_msg
from splitserve.kv_transfer.zmq_backend import ZmqKVSender
from splitserve.messages import GenerateTask, KVBootstrap, KVFailed, Message

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


class PrefillWorker(BaseWorker):
    role = "prefill"

    def __init__(self, args) -> None:
        super().__init__(args)
        self.sender = ZmqKVSender(self.pool, self.outbox)
        self.transfers: dict[str, Transfer] = {}

    def _transfer(self, rid: str, reply_addr: str = "") -> Transfer:
        t = self.transfers.get(rid)
        if t is None:
            t = Transfer(rid, reply_addr, time.monotonic() + self.args.transfer_timeout_s)
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

    def on_peer_message(self, msg: Message, frames: list) -> None:
        if isinstance(msg, KVFailed):  # the decode side gave up; it has told the server
            self.on_abort(msg.rid)
            return
        if not isinstance(msg, KVBootstrap):
            return super().on_peer_message(msg, frames)
        t = self._transfer(msg.rid)
        mismatch = self.pool.layout.mismatch(layout_from_msg(msg.layout))
        if mismatch:
            self.send(msg.dst_addr, KVFailed(msg.rid, f"refused by prefill worker: {mismatch}"))
            self._drop(t, f"refused by prefill worker: {mismatch}")
            return
        t.bootstrap = msg
        self._maybe_send(t)

    def on_step_outputs(self, outputs: list[StepOutput]) -> None:
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

    def _maybe_send(self, t: Transfer) -> None:
        if not (t.prefilled and t.bootstrap and t.req):
            return
        req, boot = t.req, t.bootstrap
        n = pages_for(req.prompt_len, self.pool.page_size)
        finished = req.finish_reason is not None
        try:
            if len(boot.page_ids) < n and not finished:
                raise ValueError(f"decode reserved {len(boot.page_ids)} pages, prompt needs {n}")
            self.sender.send(
                boot.dst_addr,
                req.rid,
                [] if finished else req.page_ids[:n],
                [] if finished else boot.page_ids[:n],
                req.output_ids[0],
                req.output_logprobs[0],
                finished,
            )
        except (PeerUnreachable, ValueError) as exc:
            self._drop(t, f"KV transfer failed: {exc}")
            return
        self.scheduler.free(req)
        del self.transfers[req.rid]

    def on_abort(self, rid: str) -> None:
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
        for t in [t for t in self.transfers.values() if t.deadline < now]:
            if t.req is None:
                # A bootstrap whose task never came (the task failed validation or was aborted).
                self.transfers.pop(t.rid, None)
            elif t.bootstrap is None:
                self._drop(t, f"KV transfer timed out: no decode worker bootstrap within "
                              f"{self.args.transfer_timeout_s:g} s")

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def num_transferring(self) -> int:
        return sum(1 for t in self.transfers.values() if t.prefilled)
