"""One engine step, the whole loop: the scheduler decides, the runner computes, the scheduler
applies (nano-vllm's ``LLMEngine.step``; vLLM v1's scheduler/executor split)."""

from __future__ import annotations

from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.sched.batch import ScheduledBatch, StepOutput
from splitserve.engine.sched.scheduler import Scheduler


class EngineCore:
    """A scheduler and the model runner it feeds; workers and tests call :meth:`step`."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.last_batch: ScheduledBatch | None = None  # the last step's (None: nothing ran)

    def step(self) -> list[StepOutput]:
        """Run one forward pass if anything can run; returns the tokens it sampled."""
        self.last_batch = batch = self.scheduler.schedule()
        if batch is None:
            return []
        return self.scheduler.update(batch, self.runner.run(batch))

    def close(self) -> None:
        self.runner.close()
