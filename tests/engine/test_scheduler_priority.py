"""``SamplingParams.priority`` in the scheduler, with no model (vLLM's semantics: lower first):
admission by priority then arrival, the least urgent running request retracted when pages run
out, a waiting prompt preempting less urgent running ones, and every output still exact and
every page back afterwards (retraction recomputes)."""

from __future__ import annotations

from splitserve.config import EngineConfig
from splitserve.engine.kv_pool import PageAllocator
from splitserve.engine.sched.prefix_cache import NoPrefixCache
from splitserve.engine.sched.request import Req
from splitserve.engine.sched.scheduler import Scheduler
from splitserve.ipc.messages import SamplingParams
from tests.engine.test_scheduler import EOS, PAGE, FakeRunner, drain, expected_output, make, step


def preq(rid: str, prompt_len: int, max_new: int, priority: int, start: int = 100) -> Req:
    return Req(rid, list(range(start, start + prompt_len)),
               SamplingParams(max_new_tokens=max_new, temperature=0, priority=priority))


def first_scheduled(sched, runner, limit: int = 500) -> list[str]:
    """Run to the end; the rids in the order each was first in a batch."""
    order: list[str] = []
    for _ in range(limit):
        if not sched.has_work:
            return order
        batch = sched.schedule()
        if batch is None:
            continue
        order.extend(r.rid for r in batch.reqs if r.rid not in order)
        sched.update(batch, runner.run(batch))
    raise AssertionError("scheduler did not drain")


def test_admission_by_priority_then_arrival() -> None:
    sched, runner = make(max_running=1)
    reqs = [preq("a", 6, 2, 0), preq("b", 6, 2, 5), preq("c", 6, 2, -1), preq("d", 6, 2, 5),
            preq("e", 6, 2, 0)]
    for r in reqs:
        sched.add(r)
    assert first_scheduled(sched, runner) == ["c", "a", "e", "b", "d"]
    assert sched.allocator.num_used == 0


def test_equal_priorities_are_first_come_first_served() -> None:
    sched, runner = make(max_running=1)
    for i in range(5):
        sched.add(preq(f"r{i}", 5, 2, 7))
    assert first_scheduled(sched, runner) == [f"r{i}" for i in range(5)]


def test_urgent_prompt_preempts_less_urgent_running_requests() -> None:
    # 12 usable pages of 4 tokens: two 16-token prompts (5 pages each with their first token)
    # run; a third, more urgent, cannot be admitted beside them.
    sched, runner = make(num_pages=13)
    low1, low2 = preq("low1", 16, 12, 10, start=100), preq("low2", 16, 12, 10, start=200)
    sched.add(low1)
    sched.add(low2)
    step(sched, runner)
    step(sched, runner)
    assert {r.rid for r in sched.running} == {"low1", "low2"}
    urgent = preq("urgent", 16, 4, 0, start=300)
    sched.add(urgent)
    batch = sched.schedule()
    assert urgent in batch.reqs  # admitted in this very step
    assert sched.num_retracted >= 1 and low2 not in sched.running  # the latest admitted went
    sched.update(batch, runner.run(batch))
    drain(sched, runner)
    for r, start in ((low1, 100), (low2, 200), (urgent, 300)):
        assert r.output_ids == expected_output(list(range(start, start + 16)),
                                               r.sampling.max_new_tokens), r.rid
    assert sched.allocator.num_used == 0


def test_less_urgent_prompt_waits_and_preempts_nobody() -> None:
    sched, runner = make(num_pages=13)
    for rid, start in (("hi1", 100), ("hi2", 200)):
        sched.add(preq(rid, 16, 12, 0, start=start))
    step(sched, runner)
    step(sched, runner)
    sched.add(preq("low", 16, 4, 10, start=300))
    for _ in range(3):
        step(sched, runner)
        assert sched.num_retracted == 0 and {r.rid for r in sched.running} == {"hi1", "hi2"}
    drain(sched, runner)
    assert sched.allocator.num_used == 0


def test_out_of_pages_retracts_the_least_urgent_not_the_latest() -> None:
    # The low-priority request is admitted first; when decoding runs the pool dry, it is the
    # one retracted although the urgent one was admitted after it (FIFO would pick the latter).
    sched, runner = make(num_pages=12)
    low, urgent = preq("low", 12, 20, 10, start=100), preq("urgent", 12, 20, 0, start=200)
    sched.add(low)
    step(sched, runner)
    sched.add(urgent)
    while sched.num_retracted == 0 and sched.has_work:
        step(sched, runner)
    assert sched.num_retracted >= 1
    assert urgent in sched.running and low not in sched.running
    drain(sched, runner)
    for r, start in ((low, 100), (urgent, 200)):
        assert r.output_ids == expected_output(list(range(start, start + 12)), 20), r.rid
    assert sched.allocator.num_used == 0


def test_urgent_prompt_takes_a_row_when_every_row_is_taken() -> None:
    # Pages to spare, but max_running rows all decode less urgent requests: the urgent prompt
    # is scheduled in the very next step, in place of the least urgent, latest admitted one,
    # and in a step of its own (no decode rows: its first token waits for nobody's).
    sched, runner = make(max_running=2)
    low1, low2 = preq("low1", 6, 12, 10, start=100), preq("low2", 6, 12, 10, start=200)
    sched.add(low1)
    sched.add(low2)
    step(sched, runner)
    assert {r.rid for r in sched.running} == {"low1", "low2"}
    urgent = preq("urgent", 6, 4, 0, start=300)
    sched.add(urgent)
    batch = sched.schedule()
    assert batch.reqs == [urgent] and low2 not in sched.running and low1 in sched.running
    assert sched.num_retracted == 1
    sched.update(batch, runner.run(batch))
    batch = sched.schedule()  # then the two rows decode together
    assert batch.reqs == [urgent, low1]
    sched.update(batch, runner.run(batch))
    drain(sched, runner)
    for r, start in ((low1, 100), (low2, 200), (urgent, 300)):
        assert r.output_ids == expected_output(list(range(start, start + 6)),
                                               r.sampling.max_new_tokens), r.rid
    assert sched.allocator.num_used == 0


def test_an_urgent_prompt_skips_the_less_urgent_rows_while_another_urgent_one_decodes() -> None:
    # One urgent request still decoding must not send the next urgent prompt into the mixed
    # steps (behind every less urgent decode row): the step holds the urgent decode row and
    # the urgent prompt, and none of the less urgent rows, which keep their pages and rows.
    sched, runner = make(num_pages=64)
    low1, low2 = preq("low1", 6, 12, 10, start=100), preq("low2", 6, 12, 10, start=200)
    sched.add(low1)
    sched.add(low2)
    step(sched, runner)
    first = preq("first", 6, 8, 0, start=300)
    sched.add(first)
    batch = sched.schedule()
    assert batch.reqs == [first]
    sched.update(batch, runner.run(batch))
    second = preq("second", 6, 8, 0, start=400)
    sched.add(second)
    batch = sched.schedule()
    assert batch.reqs == [first, second] and batch.chunk_lens == [1, 6]
    assert low1 in sched.running and low2 in sched.running and sched.num_retracted == 0
    sched.update(batch, runner.run(batch))
    batch = sched.schedule()  # nothing urgent waits: every row decodes again
    assert {r.rid for r in batch.reqs} == {"first", "second", "low1", "low2"}
    sched.update(batch, runner.run(batch))
    drain(sched, runner)
    for r in (low1, low2, first, second):
        assert r.output_ids == expected_output(list(range(r.input_ids[0], r.input_ids[0] + 6)),
                                               r.sampling.max_new_tokens), r.rid
    assert sched.allocator.num_used == 0


def test_an_urgent_prompt_longer_than_a_step_is_chunked_beside_the_decodes() -> None:
    # A step of its own only when the rest of the prompt fits one step: a longer urgent
    # prompt would stall every decode row for several steps, so it goes in the usual steps.
    sched, runner = make(num_pages=64, max_batch_tokens=16)
    low = preq("low", 6, 12, 10, start=100)
    sched.add(low)
    step(sched, runner)
    urgent = preq("urgent", 40, 2, 0, start=300)
    sched.add(urgent)
    batch = sched.schedule()
    assert batch.reqs == [low, urgent] and batch.chunk_lens == [1, 15]
    sched.update(batch, runner.run(batch))
    drain(sched, runner)
    assert urgent.output_ids == expected_output(list(range(300, 340)), 2)
    assert sched.allocator.num_used == 0


def test_an_urgent_wave_never_runs_more_than_max_running_rows() -> None:
    sched, runner = make(max_running=2)
    lows = [preq(f"low{i}", 6, 12, 10, start=100 * (i + 1)) for i in range(2)]
    for r in lows:
        sched.add(r)
    step(sched, runner)
    urgent = [preq(f"u{i}", 6, 8, 0, start=300 + 100 * i) for i in range(2)]
    for r in urgent:
        sched.add(r)
    for _ in range(6):
        batch = sched.schedule()
        sched.update(batch, runner.run(batch))
        assert len(sched.running) <= 2, [r.rid for r in sched.running]
    drain(sched, runner)
    for r in (*lows, *urgent):
        assert r.output_ids == expected_output(list(range(r.input_ids[0], r.input_ids[0] + 6)),
                                               r.sampling.max_new_tokens), r.rid
    assert sched.allocator.num_used == 0


class NoSlotLora:
    """A LoRA manager whose adapter never gets a slot (all busy)."""

    def acquire(self, adapter):
        return None

    def release(self, slot) -> None:
        pass

    def want(self, adapters) -> None:
        pass


def test_no_room_is_made_for_an_urgent_prompt_that_could_not_start_anyway() -> None:
    # Its adapter has no slot: retracting a running row for it would only recompute that row
    # each step (it is re-admitted since the head is skipped).
    alloc = PageAllocator(64)
    sched = Scheduler(NoPrefixCache(alloc, PAGE), EngineConfig(max_running=2), [EOS], False,
                      NoSlotLora())
    runner = FakeRunner()
    for rid, start in (("low1", 100), ("low2", 200)):
        sched.add(preq(rid, 20, 30, 10, start=start))
    step(sched, runner)
    urgent = preq("urgent", 6, 2, 0, start=300)
    urgent.lora = object()
    sched.add(urgent)
    for _ in range(5):
        batch = sched.schedule()
        assert [r.rid for r in batch.reqs] == ["low1", "low2"]
        sched.update(batch, runner.run(batch))
    assert sched.num_retracted == 0


def test_a_half_prefilled_less_urgent_prompt_gives_its_pages_to_an_urgent_one() -> None:
    # 10 usable pages of 4 tokens: "low" got its first 16-token chunk (4 pages) and waits for
    # the rest; "urgent" needs 8 pages, and nothing runs that could be retracted.
    sched, runner = make(num_pages=11, max_batch_tokens=16)
    low = preq("low", 25, 2, 10, start=100)
    sched.add(low)
    step(sched, runner)
    assert low.page_ids and low in sched.waiting
    urgent = preq("urgent", 30, 2, 0, start=300)
    sched.add(urgent)
    batch = sched.schedule()
    assert batch is not None and batch.reqs == [urgent]
    sched.update(batch, runner.run(batch))
    drain(sched, runner)
    for r, start, n in ((low, 100, 25), (urgent, 300, 30)):
        assert r.output_ids == expected_output(list(range(start, start + n)), 2), r.rid
    assert sched.allocator.num_used == 0


def test_an_urgent_prompt_gets_its_own_step_when_only_less_urgent_prompts_wait() -> None:
    # Nothing running (the last batch just finished) and a flood's prompts waiting: the urgent
    # prompt is not prefilled together with them (a step several times longer than its own);
    # they start in the next step, and every output is still exact.
    sched, runner = make(num_pages=64)
    lows = [preq(f"low{i}", 6, 3, 0, start=100 * (i + 1)) for i in range(3)]
    for r in lows:
        sched.add(r)
    urgent = preq("urgent", 6, 3, -1, start=900)
    sched.add(urgent)
    assert not sched.running
    batch = sched.schedule()
    assert batch.reqs == [urgent] and batch.chunk_lens == [6]
    sched.update(batch, runner.run(batch))
    batch = sched.schedule()  # nothing more urgent waits: the rest start beside its decode
    assert batch.reqs == [urgent, *lows] and batch.chunk_lens == [1, 6, 6, 6]
    sched.update(batch, runner.run(batch))
    drain(sched, runner)
    for r in (*lows, urgent):
        assert r.output_ids == expected_output(list(range(r.input_ids[0], r.input_ids[0] + 6)),
                                               r.sampling.max_new_tokens), r.rid
    assert sched.allocator.num_used == 0


def test_urgent_prompts_of_one_class_start_together_without_the_less_urgent() -> None:
    sched, runner = make(num_pages=64)
    low = preq("low", 6, 2, 3, start=100)
    u1, u2 = preq("u1", 6, 2, -2, start=200), preq("u2", 6, 2, -2, start=300)
    for r in (low, u1, u2):
        sched.add(r)
    batch = sched.schedule()
    assert batch.reqs == [u1, u2]
    sched.update(batch, runner.run(batch))
    drain(sched, runner)
    assert sched.allocator.num_used == 0
