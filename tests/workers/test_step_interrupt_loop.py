"""Steps given up for an urgent prompt, in the real worker loop over fakes: a more urgent task
arriving mid-step gives the step up, is dispatched in the next turn and runs alone, then the
given-up rows run whole; nothing is lost, every page comes back, the counter says so; equal
priorities, ``--no-interrupt-steps`` and decode workers never give a step up; urgent arrivals
faster than a step cannot starve the rows it holds."""

from __future__ import annotations

import msgspec
import pytest

from splitserve.ipc.messages import GenerateTask
from tests.workers.fakes import expected_output, joined, make_rig, task


def urgent(rid: str, priority: int = -1, start: int = 500) -> GenerateTask:
    t = task(rid, prompt_len=6, max_new=3, start=start)
    return msgspec.structs.replace(t, sampling=msgspec.structs.replace(t.sampling,
                                                                       priority=priority))


def arrive_in_step(rig, step: int, msg: GenerateTask) -> None:
    """``msg`` reaches the inbox while the runner is in its ``step``-th call (1-based)."""
    calls = [0]

    def hook(batch) -> None:
        calls[0] += 1
        if calls[0] == step:
            rig.inbox.put(msg)

    rig.runner.during_step = hook


def test_an_urgent_task_mid_step_runs_next_alone() -> None:
    rig = make_rig("colocated", max_batch_tokens=64)
    flood = [task(f"f{i}", prompt_len=10, max_new=4, start=100 + 50 * i) for i in range(3)]
    for t in flood:
        rig.worker.dispatch(t, [])
    u = urgent("u")
    arrive_in_step(rig, 1, u)
    rig.run_until_idle()
    assert rig.runner.batches[0] == ["f0", "f1", "f2"]  # given up
    assert rig.runner.batches[1] == ["u"]  # the urgent prompt's own step
    # The given-up rows again, beside the urgent one's decode.
    assert rig.runner.batches[2] == ["u", "f0", "f1", "f2"]
    assert rig.worker.core.num_interrupted == 1
    tokens = rig.tokens()
    for t in [*flood, u]:
        assert joined(tokens[t.rid]) == expected_output(t.input_ids, t.sampling.max_new_tokens)
    assert rig.errors() == []
    rig.assert_no_pages_held()


@pytest.mark.parametrize("case", ["equal priority", "switched off", "constrained"])
def test_no_step_is_given_up(case: str) -> None:
    engine = {"interrupt_steps": False} if case == "switched off" else {}
    rig = make_rig("colocated", **engine)
    rig.worker.dispatch(task("f0"), [])
    late = urgent("u", priority=0 if case == "equal priority" else -1)
    if case == "constrained":
        late = msgspec.structs.replace(late, sampling=msgspec.structs.replace(
            late.sampling, constraint=task("c", constrained=True).sampling.constraint))
    arrive_in_step(rig, 1, late)
    rig.run(2)
    if case == "constrained":
        rig.grammars.finish("u")
    rig.run_until_idle()
    assert rig.worker.core.num_interrupted == 0
    assert rig.runner.batches[0] == ["f0"] and "u" in rig.tokens()
    rig.assert_no_pages_held()


def test_a_decode_worker_never_looks() -> None:
    rig = make_rig("decode")
    assert rig.worker.urgent_peek is None and rig.runner.interrupt is None


def test_urgent_arrivals_in_every_step_cannot_starve_the_rows() -> None:
    rig = make_rig("colocated", max_batch_tokens=64)
    f0 = task("f0", prompt_len=40, max_new=3)
    rig.worker.dispatch(f0, [])
    n = [0]

    def hook(batch) -> None:  # a new urgent prompt during every step that holds f0
        if any(r.rid == "f0" for r in batch.reqs):
            n[0] += 1
            rig.inbox.put(urgent(f"u{n[0]}", start=1000 + 10 * n[0]))

    rig.runner.during_step = hook
    rig.run_until_idle(limit=100)  # f0's steps alternate: given up, then whole
    assert joined(rig.tokens()["f0"]) == expected_output(f0.input_ids, 3)
    f0_steps = [b for b in rig.runner.batches if "f0" in b]
    assert rig.worker.core.num_interrupted == len(f0_steps) // 2 >= 1
    assert rig.errors() == []
    rig.assert_no_pages_held()
