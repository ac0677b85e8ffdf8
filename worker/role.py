"""A worker role: what it is at set-up (four traits) and the policy that decides what each event
means for it.

The worker loop (``worker.loop.Worker``) is the same for every role; it hands each event to the
role's :class:`RolePolicy`, one method per kind of event, and the policy acts through the parts
it was built with (the scheduler, its KV transfer sessions) and the worker's port (send, emit,
fail: ``worker.port``). Policies are plain objects: ``prefill.policy.PrefillPolicy``,
``decode.policy.DecodePolicy``, ``worker.colocated.ColocatedPolicy``. The registry names each
role's :class:`WorkerRole` (``config.registry.WORKER_ROLE``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from splitserve.engine.sched.batch import StepOutput
    from splitserve.engine.sched.request import Req
    from splitserve.ipc.frames import Frames
    from splitserve.ipc.messages import GenerateTask, Message, WorkerStats
    from splitserve.worker.grammars import CompileDone
    from splitserve.worker.parts import WorkerParts


class RolePolicy(Protocol):
    """What one role does with each event of the worker loop. A method may raise
    ``PeerUnreachable`` or ``IllegalTransition`` for a message it cannot act on (the loop logs
    it and serves on); after every event the loop admits the requests whose KV is coming
    (``Scheduler.admit_waiting_for_kv``) and hands those admitted to :meth:`on_admitted`."""

    def on_task(self, task: GenerateTask) -> None:
        """A ``GenerateTask`` from a router."""

    def on_abort(self, rid: str) -> None:
        """Drop ``rid`` (the router aborted it, or went away): free what it holds here."""

    def on_peer(self, msg: Message, frames: Frames | list) -> None:
        """A message from another worker (the KV handoff's), with its raw frames."""

    def on_compiled(self, done: CompileDone) -> None:
        """A request's constraint compiled (``done.req.grammar`` set) or failed."""

    def on_admitted(self, reqs: list[Req]) -> None:
        """The scheduler reserved pages for these requests whose KV is coming."""

    def on_step(self, outputs: list[StepOutput]) -> None:
        """One engine step ran; ``outputs``: the tokens it sampled."""

    def on_tick(self, now: float) -> None:
        """Once per loop iteration: deadlines and keepalives at ``now`` (the worker's clock)."""

    def step_keepalives(self) -> list[tuple[str, Message]]:
        """``(peer inbox, message)`` to repeat while the next engine step runs, should it take
        longer than a third of ``transfer_timeout_s`` (``worker.step_keepalive``): a prefill
        worker's ``KVKeepalive`` for each request a decode worker waits for; none elsewhere."""

    def held(self) -> dict[str, str]:
        """``rid -> reply_addr`` of every request held here for a router (queued, compiling,
        running, in a KV handoff that still answers to it)."""

    def num_transferring(self) -> int:
        """Requests whose KV is being sent or received (``WorkerStats.num_transferring``)."""

    def fill_stats(self, stats: WorkerStats) -> WorkerStats:
        """Add the role's own counters to ``stats`` (queued handoffs, the transfer backend's)."""

    def close(self) -> None:
        """Release what the role holds outside the engine (its KV transfer backend)."""


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """A role as the worker is built for it; never compared by name.

    ``computes_prompts``: it prefills new prompts, so the prefix cache applies.
    ``decodes``: requests stay after their first token (jump-forward, CUDA graphs, drafts).
    ``receives_kv``: its pool is written by KV transfer (a receiver and receive sessions; it
    watches its links to prefill workers). ``sends_kv``: it ships prompts' KV (a sender and
    send sessions). ``create_policy``: the role's policy over the built parts.
    """

    name: str
    computes_prompts: bool
    decodes: bool
    receives_kv: bool
    sends_kv: bool
    create_policy: Callable[[WorkerParts], RolePolicy]
