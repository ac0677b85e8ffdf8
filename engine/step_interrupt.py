"""A step given up between two of its layers, so that a more urgent prompt starts sooner.

Under a flood, an urgent prompt (a lower ``priority``: vLLM's semantics) that arrives while a
long step runs waits for that step to end before its own step starts: the step in flight was
most of what was left of its time to the first token (docs/operations.md, "Priorities under
overload"). So the runner may hand the model an *interrupt check*, called between layers of a
step that runs layer by layer (a mixed or prompt step; the one-call fused decode layers and
replayed CUDA graphs run whole): when it answers True the model raises :class:`StepInterrupted`
and the engine core drops the step (``EngineCore.step`` returns no outputs).

Nothing is lost, because nothing a step writes before its end is read as valid: the scheduler
advances a request's ``kv_len`` only when its step ends (``Scheduler.update``), and every
position at or past ``kv_len`` is written again, at every layer, before any later step reads it
(the pool's pages and the decode cache's slots alike: a row appends its position's K/V before it
attends). The pages the scheduler gave the step stay with their requests, so the next step (the
urgent one, then the dropped one's rows again) starts from the same state. The cost is the part
of the step that ran. A row whose step was given up runs its next step whole
(``Req.given_up``), so urgent prompts arriving faster than a step lasts cannot starve it.

When: the scheduler sets ``ScheduledBatch.interrupt_floor``, the least urgent priority among
the rows, and the check answers True for a new request more urgent than that, the class that
``Scheduler.schedule`` then gives a step without the less urgent rows
(``engine.sched.preemption.urgent_class``).
"""

from __future__ import annotations

from collections.abc import Callable

# Given the least urgent priority among the step's rows (lower is more urgent): whether a
# request more urgent than that has arrived and the step should be given up.
InterruptCheck = Callable[[int], bool]


class StepInterrupted(Exception):
    """Raised by the model between layers when the step's interrupt check answered True.

    Attributes:
        layer: the layers the step had run (``1..num_layers - 1``).
    """

    def __init__(self, layer: int) -> None:
        super().__init__(f"step interrupted after {layer} layer(s)")
        self.layer = layer
