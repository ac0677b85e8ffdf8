"""The colocated worker: prefill and decode in one process, no KV transfer (role ``colocated``).

It is the baseline disaggregation is measured against, and the simplest way to serve on one
small machine: a task is compiled (when constrained), prefilled here, decoded here, and its
tokens stream to the server as the scheduler samples them.
"""

from __future__ import annotations

from splitserve.engine.sched.batch import StepOutput
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import GenerateTask, WorkerStats
from splitserve.worker.base import BaseWorker
from splitserve.worker.grammars import CompileDone


class ColocatedWorker(BaseWorker):
    role = "colocated"
    computes_prompts = True
    decodes = True
    receives_kv = False

    def __init__(self, config) -> None:
        super().__init__(config)
        self.compiling: dict[str, Req] = {}  # constrained requests whose grammar compiles

    def on_generate(self, task: GenerateTask) -> None:
        error = self.check_fits(task)
        if error:
            self.fail(task.rid, task.reply_addr, error, 400)
            return
        req = self.new_req(task)
        if task.sampling.constraint is not None:
            self.compiling[req.rid] = req
            self.grammars.submit(req)  # joins the scheduler in on_grammar_done
        else:
            self.scheduler.add(req)

    def on_grammar_done(self, done: CompileDone) -> None:
        req = self.compiling.pop(done.req.rid, None)
        if req is not done.req:
            return  # aborted while compiling
        if done.error is not None:
            self.fail(req.rid, req.reply_addr, done.error, done.code)
        else:
            self.scheduler.add(req)

    def on_step_outputs(self, outputs: list[StepOutput]) -> None:
        self.emit_decoded(outputs)

    def held_requests(self) -> dict[str, str]:
        held = super().held_requests()
        held.update((rid, req.reply_addr) for rid, req in self.compiling.items())
        return held

    def on_abort(self, rid: str) -> None:
        self.grammars.discard(rid)
        self.compiling.pop(rid, None)
        self.scheduler.abort(rid)

    def stats(self, query_id: int = 0) -> WorkerStats:
        s = super().stats(query_id)
        s.num_waiting += len(self.compiling)
        return s
