"""One engine step, the whole loop: the scheduler decides, the runner computes, the scheduler
applies (nano-vllm's ``LLMEngine.step``; vLLM v1's scheduler/executor split)."""

from __future__ import annotations

import time

from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.sched.batch import ScheduledBatch, StepOutput
from splitserve.engine.sched.scheduler import Scheduler
from splitserve.engine.step_interrupt import StepInterrupted


class EngineCore:
    """A scheduler and the model runner it feeds; workers and tests call :meth:`step`."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.last_batch: ScheduledBatch | None = None  # the last step's (None: nothing ran)
        self.num_interrupted = 0  # steps given up between layers (engine.step_interrupt)

    def step(self) -> list[StepOutput]:
        """Run one forward pass if anything can run; returns the tokens it sampled (none when
        the runner's interrupt check gave the step up: its rows run again from where they
        were, :mod:`~splitserve.engine.step_interrupt`)."""
        self.last_batch = batch = self.scheduler.schedule()
        if batch is None:
            return []
        start = time.perf_counter()
        try:
            output = self.runner.run(batch)
        except StepInterrupted:
            for r in batch.reqs:  # nothing of it applies; their next step runs whole
                r.given_up = True
            self.last_batch = None
            self.num_interrupted += 1
            return []
        # The prefill rate that loads from lower cache tiers are weighed against: steps that are
        # mostly prompt chunks (a decode row is one token).
        prompt_tokens = sum(n for n in batch.chunk_lens if n > 1)
        if prompt_tokens >= 0.9 * batch.num_tokens:
            self.scheduler.cache.observe_prefill(prompt_tokens, time.perf_counter() - start)
        return self.scheduler.update(batch, output)

    def close(self) -> None:
        self.runner.close()
        self.scheduler.cache.close()
