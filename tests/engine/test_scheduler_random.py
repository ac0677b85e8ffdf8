"""The scheduler under random arrivals, priorities and budgets, with no model: every request ends
with the exact greedy output of the fake runner (retraction recomputes), pages add up after
every step (``check_pages``), the queue always drains (no deadlock, no livelock), and the
running rows never exceed ``max_running``. Seeds fixed, so a failure names its seed; this found
an urgent step past ``max_running`` and two deadlocks (a half-prefilled prompt behind a new one
that must wait; one less urgent holding the pages an urgent prompt needs)."""

from __future__ import annotations

import random

import pytest

from tests.engine.test_scheduler import expected_output, make, step
from tests.engine.test_scheduler_priority import preq

SEEDS = 1500
MAX_STEPS = 3000


def run(seed: int) -> None:
    rng = random.Random(seed)
    num_pages, max_running = rng.randint(4, 24), rng.randint(1, 3)
    max_batch_tokens, cache = rng.choice([4, 8, 16, 64]), rng.choice(["none", "radix"])
    sched, runner = make(num_pages=num_pages, cache=cache, max_running=max_running,
                         max_batch_tokens=max_batch_tokens)
    arrivals = sorted(rng.randint(0, 30) for _ in range(rng.randint(1, 8)))
    reqs, k, steps = [], 0, 0
    where = f"seed {seed}: pages {num_pages}, max_running {max_running}, " \
            f"max_batch_tokens {max_batch_tokens}, cache {cache}"
    while k < len(arrivals) or sched.has_work:
        while k < len(arrivals) and arrivals[k] <= steps:
            while True:
                prompt_len, max_new = rng.randint(1, 30), rng.randint(1, 12)
                if sched.fits_pool(prompt_len + max_new):
                    break
            start = rng.choice([100, 100, 200, 300 + 40 * k])  # some share a prefix
            r = preq(f"r{k}", prompt_len, max_new, rng.choice([-5, 0, 0, 3, 10]), start=start)
            reqs.append((r, start, prompt_len))
            sched.add(r)
            k += 1
        step(sched, runner)
        sched.check_pages()
        assert len(sched.running) <= max_running, where
        steps += 1
        assert steps < MAX_STEPS, f"no drain: {where}: waiting " + str(
            [(r.rid, r.sampling.priority, len(r.page_ids)) for r in sched.waiting])
    for r, start, prompt_len in reqs:
        assert r.output_ids == expected_output(list(range(start, start + prompt_len)),
                                               r.sampling.max_new_tokens), f"{r.rid}, {where}"
    if cache == "none":
        assert sched.allocator.num_used == 0, where


@pytest.mark.parametrize("block", range(5))
def test_random_arrivals_and_priorities_all_finish_exactly(block: int) -> None:
    for seed in range(block * SEEDS // 5, (block + 1) * SEEDS // 5):
        run(seed)
