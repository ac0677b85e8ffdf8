"""The colocated role: prefill and decode in one worker, no KV transfer (role ``colocated``).

It is the baseline disaggregation is measured against, and the simplest way to serve on one
small machine: a task is compiled (when constrained), prefilled here, decoded here, and its
tokens stream to the router as the scheduler samples them. Its policy is a composition of what
the other roles share: the prompt stage of the prefill role (``worker.prompts``) and the token
outputs of the decode role (``worker.outputs``).
"""

from __future__ import annotations

import logging

from splitserve.engine.sched.batch import StepOutput
from splitserve.engine.sched.request import Req
from splitserve.engine.sched.scheduler import Scheduler
from splitserve.ipc.frames import Frames
from splitserve.ipc.messages import FailureKind, GenerateTask, Message, WorkerStats
from splitserve.worker.grammars import CompileDone
from splitserve.worker.outputs import decoded_outputs
from splitserve.worker.parts import WorkerParts
from splitserve.worker.port import WorkerPort
from splitserve.worker.prompts import PromptStage
from splitserve.worker.role import WorkerRole

logger = logging.getLogger(__name__)


class ColocatedPolicy:
    """What the colocated worker does with each event (``worker.role.RolePolicy``).

    Args:
        scheduler: the worker's scheduler (prefills and decodes).
        prompts: how tasks reach it.
        port: where tokens and failures go.
    """

    def __init__(self, scheduler: Scheduler, prompts: PromptStage, port: WorkerPort) -> None:
        self.scheduler = scheduler
        self.prompts = prompts
        self.port = port

    @classmethod
    def from_parts(cls, parts: WorkerParts) -> ColocatedPolicy:
        """The policy over a built worker's parts."""
        prompts = PromptStage(parts.scheduler, parts.grammars, parts.port,
                              parts.model_config.context_len)
        return cls(parts.scheduler, prompts, parts.port)

    def on_task(self, task: GenerateTask) -> None:
        """Schedule the task's request (after its compile, when constrained)."""
        req = self.prompts.accept(task)
        if req is not None:
            self.prompts.start(req)

    def on_abort(self, rid: str) -> None:
        """Drop ``rid``, compiling or scheduled; its pages go back."""
        self.prompts.drop(rid)
        self.scheduler.abort(rid)

    def on_peer(self, msg: Message, frames: Frames | list) -> None:
        """Nothing: no other worker talks to a colocated one."""
        logger.warning("colocated worker ignores %s", type(msg).__name__)

    def on_compiled(self, done: CompileDone) -> None:
        """Schedule a compiled request; fail one whose constraint did not compile."""
        if not self.prompts.compiled(done):
            req = done.req
            self.port.fail(req.rid, req.reply_addr, done.error, done.code, FailureKind.GRAMMAR)

    def on_admitted(self, reqs: list[Req]) -> None:
        """Nothing: no request here waits for KV."""

    def on_step(self, outputs: list[StepOutput]) -> None:
        """Send every sampled (and jumped-over) token."""
        self.port.emit(decoded_outputs(outputs))

    def on_tick(self, now: float) -> None:
        """Nothing: no deadline here."""

    def held(self) -> dict[str, str]:
        """The scheduler's requests and those compiling."""
        s = self.scheduler
        return {r.rid: r.reply_addr for r in (*s.waiting, *s.running, *self.prompts.compiling())}

    def step_keepalives(self) -> list[tuple[str, Message]]:
        """None: no peer waits on this worker's steps."""
        return []

    def num_transferring(self) -> int:
        """None: nothing is transferred."""
        return 0

    def fill_stats(self, stats: WorkerStats) -> WorkerStats:
        """Requests compiling count as waiting."""
        stats.num_waiting += len(self.prompts.compiling())
        return stats

    def close(self) -> None:
        """Nothing: no KV transfer backend."""


COLOCATED = WorkerRole("colocated", computes_prompts=True, decodes=True, receives_kv=False,
                       sends_kv=False, create_policy=ColocatedPolicy.from_parts)
