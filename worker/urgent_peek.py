"""Between the layers of a step, a look at the inbox for a prompt more urgent than the step.

The worker's loop reads its inbox only between steps, so an urgent prompt (a lower
``priority``) that arrives while a long step runs waits for that step's end. The runner calls
:meth:`UrgentPeek.check` between layers (``ModelRunner.interrupt``,
:mod:`~splitserve.engine.step_interrupt`): it receives whatever has arrived, keeps it in
arrival order with its frames (:meth:`drain` hands it to the loop, which dispatches it before
anything newer), and answers True when one of those messages is a new request that is more
urgent than some row of the step (than its least urgent, ``ScheduledBatch.interrupt_floor``) and
can start at once: no grammar to compile, no adapter.
Then the step is given up and the urgent prompt's own step runs next
(``Scheduler.schedule``'s urgent class).

Only a worker that prefills prompts (colocated, prefill) looks: a decode worker's first token
of a request comes from its prefill worker. With every priority equal nothing is ever
interrupted, and the cost is one ``poll`` of the socket per layer (microseconds).
"""

from __future__ import annotations

from collections import deque

from splitserve.ipc.frames import FrameList, as_frames
from splitserve.ipc.messages import GenerateTask, Message
from splitserve.ipc.sockets import Inbox

# Messages kept between two turns of the loop at most: past it the peek stops receiving (the
# rest wait in the socket as before), so a burst cannot grow the worker's memory.
MAX_KEPT = 256


class UrgentPeek:
    """The interrupt check of a prefilling worker's steps, over its ``inbox``.

    Attributes:
        num_interrupts: how many times :meth:`check` answered True.
    """

    def __init__(self, inbox: Inbox, max_kept: int = MAX_KEPT) -> None:
        self.inbox = inbox
        self.max_kept = max_kept
        self._kept: deque[tuple[Message, FrameList]] = deque()
        self.num_interrupts = 0

    def check(self, floor: int) -> bool:
        """Receive what has arrived; True when a new request among it has a ``priority`` below
        ``floor`` (the least urgent of the step's rows), no constraint and no adapter."""
        urgent = False
        while len(self._kept) < self.max_kept and self.inbox.poll(0):
            item = self.inbox.recv()
            if item is None:
                continue  # a malformed header: dropped (and logged) by the inbox
            msg, frames = item[0], as_frames(item[1])
            held = []
            while frames.more:  # zero-copy views; the inbox would discard them on its next recv
                held.append(frames.read())
            self._kept.append((msg, FrameList(held)))
            if (isinstance(msg, GenerateTask) and msg.sampling.priority < floor
                    and msg.sampling.constraint is None and msg.lora is None):
                urgent = True
        if urgent:
            self.num_interrupts += 1
        return urgent

    def drain(self) -> list[tuple[Message, FrameList]]:
        """The messages received by :meth:`check` since the last call, oldest first."""
        kept = list(self._kept)
        self._kept.clear()
        return kept
