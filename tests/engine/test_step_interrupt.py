"""Steps given up between layers (engine.step_interrupt) lose nothing: the same prompts, run
with every other layer-by-layer step interrupted at a varying layer, give the same tokens (bit
for bit: the rerun is the same step) and free every page; and an urgent request added when a
step is interrupted runs next, alone, while the others still give their own greedy tokens."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.kv_pool import KVPool
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams
from tests.cpu_kernels import load_or_fail
from tests.engine_core import make_core

PROMPT_LENS = (37, 90, 12, 61)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def req(rid: str, ids: list[int], priority: int = 0, max_new: int = 6) -> Req:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True,
                            priority=priority)
    return Req(rid=rid, input_ids=ids, sampling=params)


class EveryOtherStep:
    """An interrupt check that answers True once in every other step that asks, after a number
    of layers that moves on each time (1, 5, 9, ...: a step is given up at many depths)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.calls = 0  # calls in the current step
        self.steps = 0
        self.fired = 0
        self.floors: list[int] = []

    def new_step(self) -> None:
        self.calls = 0
        self.steps += 1

    def __call__(self, floor: int) -> bool:
        self.calls += 1
        if self.steps % 2 or self.calls != 1 + (4 * self.fired) % (self.num_layers - 1):
            return False
        self.fired += 1
        self.floors.append(floor)
        return True


def run(model, cfg, dtype: str, interrupt: EveryOtherStep | None) -> tuple[list[list[int]], int]:
    model.attn_backend.decode_cache = None
    pool = KVPool(cfg.kv_layout(16, dtype), 96)
    core = make_core(model, pool, cfg.eos_token_ids, max_batch_tokens=48)
    core.runner.interrupt = interrupt
    reqs = [req(f"r{i}", ids) for i, ids in enumerate(prompts())]
    core.scheduler.add(reqs[0])
    core.scheduler.add(reqs[1])
    steps = 0
    while core.scheduler.has_work:
        if interrupt is not None:
            interrupt.new_step()
        core.step()
        steps += 1
        if steps == 3:  # later arrivals join running decodes: mixed steps
            core.scheduler.add(reqs[2])
            core.scheduler.add(reqs[3])
        assert steps < 400
    assert pool.allocator.num_used == 0  # every page back
    return [r.output_ids for r in reqs], core.num_interrupted


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interrupted_steps_give_the_same_tokens(model_path, dtype: str) -> None:
    from splitserve.engine.model.loader import load_model

    if dtype == "bfloat16" and load_or_fail() is None:
        pytest.skip("no C compiler: the bfloat16 path is the C kernels' (decode cache)")
    model, cfg = load_model(model_path, dtype=getattr(torch, dtype))
    plain, none = run(model, cfg, dtype, None)
    check = EveryOtherStep(cfg.num_layers)
    interrupted, count = run(model, cfg, dtype, check)
    assert none == 0
    assert count == check.fired >= 4
    assert set(check.floors) == {0}
    assert interrupted == plain
    assert all(len(ids) == 6 for ids in plain)


def test_urgent_request_runs_alone_after_an_interrupt(model_path) -> None:
    from splitserve.engine.model.loader import load_model

    model, cfg = load_model(model_path, dtype=torch.float32)
    ids = prompts()

    def solo(i: int) -> list[int]:
        pool = KVPool(cfg.kv_layout(16, "float32"), 96)
        core = make_core(model, pool, cfg.eos_token_ids)
        r = req("solo", ids[i])
        core.scheduler.add(r)
        while core.scheduler.has_work:
            core.step()
        return r.output_ids

    pool = KVPool(cfg.kv_layout(16, "float32"), 96)
    core = make_core(model, pool, cfg.eos_token_ids, max_batch_tokens=48)
    flood = [req(f"f{i}", ids[i]) for i in (0, 1, 3)]
    urgent = req("urgent", ids[2], priority=-1)
    calls = {}  # step number -> interrupt checks in it

    def check(floor: int) -> bool:
        # The urgent prompt "arrives" during the third step, after its fourth layer.
        calls[step] = calls.get(step, 0) + 1
        return step == 3 and calls[step] == 4

    core.runner.interrupt = check
    for r in flood:
        core.scheduler.add(r)
    batches = []
    step = 0
    while core.scheduler.has_work:
        step += 1
        core.step()
        if step == 3:
            core.scheduler.add(urgent)
        if core.last_batch is not None:
            batches.append([r.rid for r in core.last_batch.reqs])
        assert step < 400
    assert core.num_interrupted == 1
    assert batches[2] == ["urgent"]  # the step after the interrupted one: the urgent one alone
    assert pool.allocator.num_used == 0
    assert urgent.output_ids == solo(2)
    for i, r in zip((0, 1, 3), flood, strict=True):
        assert r.output_ids == solo(i), r.rid
