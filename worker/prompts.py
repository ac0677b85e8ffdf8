"""How a role that computes prompts (colocated, prefill) takes a task in: refuse what can never
run here, else make its request and schedule it, at once or once its constraint compiled.

Compiles run on the grammar service's threads; a request still compiling is not in the
scheduler yet, so it never holds up the others.
"""

from __future__ import annotations

from splitserve.engine.sched.request import Req
from splitserve.engine.sched.scheduler import Scheduler
from splitserve.ipc.messages import FailureKind, GenerateTask
from splitserve.worker.grammars import CompileDone, WorkerGrammars
from splitserve.worker.port import WorkerPort
from splitserve.worker.tasks import new_req, task_error


class PromptStage:
    """Tasks whose prompt this worker computes, up to the scheduler.

    Args:
        scheduler: the worker's scheduler.
        grammars: the worker's grammar compiles.
        port: where a refused task is reported (400, ``FailureKind.INVALID``).
        context_len: the model's context, in tokens.
    """

    def __init__(self, scheduler: Scheduler, grammars: WorkerGrammars, port: WorkerPort,
                 context_len: int) -> None:
        self.scheduler = scheduler
        self.grammars = grammars
        self.port = port
        self.context_len = context_len

    def accept(self, task: GenerateTask) -> Req | None:
        """The request for ``task``, or None when it can never run here (then reported)."""
        error = task_error(task, self.scheduler, self.context_len)
        if error:
            self.port.fail(task.rid, task.reply_addr, error, 400, FailureKind.INVALID)
            return None
        return new_req(task, self.scheduler)

    def start(self, req: Req) -> None:
        """Schedule ``req`` now, or compile its constraint first (:meth:`compiled` then
        schedules it)."""
        if req.sampling.needs_grammar:
            self.grammars.submit(req)
        else:
            self.scheduler.add(req)

    def compiled(self, done: CompileDone) -> bool:
        """A compile finished: schedule its request. False when it failed (``done.error``;
        the caller reports it)."""
        if done.error is not None:
            return False
        self.scheduler.add(done.req)
        return True

    def drop(self, rid: str) -> None:
        """Forget ``rid``'s compile, if it is still compiling (aborted)."""
        self.grammars.discard(rid)

    def compiling(self) -> list[Req]:
        """The requests whose constraint still compiles."""
        return self.grammars.pending()
