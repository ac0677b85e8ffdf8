"""The scheduler with no model: a fake runner, a page allocator and no tensors (as vLLM's
``tests/v1/core`` test its KV manager). Admission, chunked prefill, retraction, finish, abort,
and that every page comes back; plus a hypothesis state machine against a naive reference."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from splitserve.config import EngineConfig
from splitserve.engine.kv_pool import PageAllocator, pages_for
from splitserve.engine.sched.batch import ModelOutput, ScheduledBatch
from splitserve.engine.sched.prefix_cache import NoPrefixCache
from splitserve.engine.sched.request import Req
from splitserve.engine.sched.scheduler import Scheduler
from splitserve.ipc.messages import SamplingParams
from splitserve.radix_cache.prefix_cache import RadixPrefixCache

PAGE = 4
EOS = 2


class FakeRunner:
    """Samples ``next_token(sequence)`` for each sampled row; records every batch it ran."""

    def __init__(self) -> None:
        self.batches: list[ScheduledBatch] = []

    @staticmethod
    def next_token(seq: list[int]) -> int:
        return 10 + (sum(seq) * 31 + len(seq)) % 50  # never EOS

    def run(self, batch: ScheduledBatch) -> ModelOutput:
        self.batches.append(batch)
        for r, n in zip(batch.reqs, batch.chunk_lens):
            assert n >= 1 and r.kv_len + n <= r.seq_len
            assert len(r.page_ids) >= pages_for(r.kv_len + n, PAGE), "pages not allocated"
        picked = [batch.reqs[i] for i in batch.sample_rows]
        tokens = [self.next_token(r.tokens(0, r.seq_len)) for r in picked]
        return ModelOutput(tokens, [-0.5] * len(tokens))


def make(num_pages: int = 64, cache: str = "none", prefill_only: bool = False,
         **engine) -> tuple[Scheduler, FakeRunner]:
    alloc = PageAllocator(num_pages)
    kind = NoPrefixCache if cache == "none" else RadixPrefixCache
    sched = Scheduler(kind(alloc, PAGE), EngineConfig(**engine), [EOS], prefill_only)
    return sched, FakeRunner()


def req(rid: str, prompt_len: int, max_new: int, start: int = 100) -> Req:
    return Req(rid, list(range(start, start + prompt_len)),
               SamplingParams(max_new_tokens=max_new, temperature=0))


def step(sched: Scheduler, runner: FakeRunner):
    batch = sched.schedule()
    return [] if batch is None else sched.update(batch, runner.run(batch))


def drain(sched: Scheduler, runner: FakeRunner, limit: int = 1000) -> None:
    for _ in range(limit):
        if not sched.has_work:
            return
        step(sched, runner)
    raise AssertionError("scheduler did not drain")


def expected_output(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(FakeRunner.next_token(seq))
    return seq[len(prompt):]


def test_schedule_returns_data_and_update_applies_it() -> None:
    sched, _runner = make()
    r = req("a", 10, 3)
    sched.add(r)
    batch = sched.schedule()
    assert batch is not None and batch.reqs == [r] and batch.chunk_lens == [10]
    assert batch.sample_rows == [0] and r.kv_len == 0  # nothing applied before update
    assert len(r.page_ids) == pages_for(10, PAGE)
    outs = sched.update(batch, ModelOutput([42], [-1.0]))
    assert [o.token_id for o in outs] == [42] and r.output_ids == [42] and r.kv_len == 10
    assert sched.running == [r] and not sched.waiting


def test_chunked_prefill_samples_only_at_the_end() -> None:
    sched, runner = make(max_batch_tokens=8)
    r = req("a", 20, 2)
    sched.add(r)
    assert step(sched, runner) == [] and r.kv_len == 8
    assert step(sched, runner) == [] and r.kv_len == 16
    (out,) = step(sched, runner)
    assert r.kv_len == 20 and out.token_id == r.output_ids[0]
    assert [b.chunk_lens for b in runner.batches] == [[8], [8], [4]]
    assert [b.sample_rows for b in runner.batches] == [[], [], [0]]


def test_decode_first_then_prompt_chunks_under_the_budget() -> None:
    sched, runner = make(max_batch_tokens=6)
    a, b = req("a", 4, 5), req("b", 12, 2, start=300)
    sched.add(a)
    step(sched, runner)  # a prefilled
    sched.add(b)
    step(sched, runner)
    last = runner.batches[-1]
    assert last.reqs == [a, b] and last.chunk_lens == [1, 5]  # decode row, then 5 prompt tokens


def test_finish_frees_every_page_and_output_is_exact() -> None:
    sched, runner = make()
    reqs = [req(f"r{i}", 3 + 5 * i, 4 + i, start=100 * i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    drain(sched, runner)
    for r in reqs:
        assert r.finish_reason == "length"
        assert r.output_ids == expected_output(r.input_ids, r.sampling.max_new_tokens)
        assert r.page_ids == []
    assert sched.allocator.num_used == 0


def test_admission_waits_for_pages_in_arrival_order() -> None:
    # 9 usable pages of 4 tokens: a takes 4, b would need 6, c (1 page) queues behind b.
    sched, runner = make(num_pages=10)
    a, b, c = req("a", 14, 4), req("b", 22, 8, start=200), req("c", 2, 2, start=400)
    for r in (a, b, c):
        sched.add(r)
    step(sched, runner)
    assert sched.running == [a] and list(sched.waiting) == [b, c]  # b does not fit: c waits too
    assert not sched.can_admit(pages_for(b.seq_len + 1, PAGE))
    drain(sched, runner)
    assert all(r.finish_reason == "length" for r in (a, b, c))
    assert sched.allocator.num_used == 0


def test_can_admit_keeps_a_page_of_headroom_per_running_request() -> None:
    sched, runner = make(num_pages=11)  # 10 usable
    for i in range(3):
        sched.add(req(f"r{i}", 3, 20, start=100 * i))
    step(sched, runner)
    assert len(sched.running) == 3 and sched.allocator.num_free == 7
    assert sched.can_admit(4) and not sched.can_admit(5)  # 4 + 3 running <= 7 free


def test_retraction_recomputes_and_continues_the_same_sequence() -> None:
    # Two requests that outgrow a tiny pool: one is retracted, re-prefilled over prompt +
    # output later, and both end with exactly the tokens of an unconstrained run.
    sched, runner = make(num_pages=9)  # 8 usable pages = 32 tokens
    a, b = req("a", 6, 14), req("b", 6, 14, start=500)
    sched.add(a)
    sched.add(b)
    drain(sched, runner)
    assert sched.num_retracted > 0
    for r in (a, b):
        assert r.output_ids == expected_output(r.input_ids, 14)
    assert sched.allocator.num_used == 0


def test_abort_from_waiting_and_running_frees_pages() -> None:
    sched, runner = make(max_batch_tokens=4)
    a, b = req("a", 3, 10), req("b", 10, 10, start=200)
    sched.add(a)
    sched.add(b)
    step(sched, runner)  # a prefilled and running, b half-prefilled and waiting
    assert b.page_ids and b in sched.waiting and a in sched.running
    assert sched.abort("b") is b and b.page_ids == []
    assert sched.abort("a") is a and sched.abort("missing") is None
    assert not sched.has_work and sched.allocator.num_used == 0


def test_prefill_only_hands_the_request_over_with_its_pages() -> None:
    sched, runner = make(prefill_only=True)
    r = req("a", 9, 5)
    sched.add(r)
    (out,) = step(sched, runner)
    assert out.prefilled and not out.finished and not sched.has_work
    assert len(r.page_ids) == pages_for(9 + 1, PAGE)  # held while its KV is sent (SENDING_KV)
    sched.check_pages()
    sched.release(r)
    assert sched.allocator.num_used == 0


def test_stop_token_finishes_with_stop() -> None:
    sched, _runner = make()
    r = req("a", 5, 10)
    sched.add(r)
    batch = sched.schedule()
    (out,) = sched.update(batch, ModelOutput([EOS], [-0.1]))
    assert out.finished and r.finish_reason == "stop" and sched.allocator.num_used == 0


def test_radix_cache_reuses_a_prefix_without_a_model() -> None:
    sched, runner = make(cache="radix")
    first, second = req("a", 13, 2), req("b", 13, 2)
    sched.add(first)
    drain(sched, runner)
    sched.add(second)
    drain(sched, runner)
    assert second.cached_len == 12  # three full pages of the 13-token prompt
    assert second.output_ids == first.output_ids
    sched.check_pages()


class SchedulerMachine(RuleBasedStateMachine):
    """Random adds, aborts and steps against a reference: each finished request's output is
    exactly what the fake model makes of its prompt, whatever was retracted or chunked; no page
    leaks or is counted twice; abort of a live request always returns it."""

    def __init__(self) -> None:
        super().__init__()
        self.sched, self.runner = make(num_pages=24, max_batch_tokens=16, max_running=4)
        self.live: dict[str, Req] = {}
        self.done: list[Req] = []
        self.n = 0

    @rule(prompt_len=st.integers(1, 30), max_new=st.integers(1, 12))
    def add(self, prompt_len: int, max_new: int) -> None:
        if pages_for(prompt_len + max_new, PAGE) > 23:
            return  # never fits: the worker refuses it before the scheduler
        r = req(f"r{self.n}", prompt_len, max_new, start=7 * self.n)
        self.n += 1
        self.sched.add(r)
        self.live[r.rid] = r

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        assert self.sched.abort(rid) is self.live.pop(rid)

    @rule()
    def step(self) -> None:
        for out in step(self.sched, self.runner):
            if out.finished:
                self.done.append(self.live.pop(out.req.rid))

    @invariant()
    def pages_accounted(self) -> None:
        self.sched.check_pages()
        for r in self.done:
            assert r.page_ids == []
            assert r.output_ids == expected_output(r.input_ids, r.sampling.max_new_tokens)

    def teardown(self) -> None:
        drain(self.sched, self.runner)
        assert self.sched.allocator.num_used == 0


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_chunked_prefill_size_bounds_prompt_tokens_beside_decode_rows_only() -> None:
    # SGLang's --chunked-prefill-size: a step that decodes takes at most that many prompt
    # tokens (the step stays short for the decode rows and for an urgent prompt waiting on it);
    # a step without decode rows takes the whole max_batch_tokens budget.
    sched, runner = make(num_pages=64, max_batch_tokens=64, chunked_prefill_size=8)
    a, b = req("a", 20, 6, start=100), req("b", 30, 4, start=200)
    sched.add(a)
    batch = sched.schedule()
    assert batch.reqs == [a] and batch.chunk_lens == [20]  # nothing decodes: no bound
    sched.update(batch, runner.run(batch))
    sched.add(b)
    lens = []
    while b.kv_len < 30:
        batch = sched.schedule()
        assert batch.reqs[0] is a and sum(batch.chunk_lens[1:]) <= 8
        lens.append(batch.chunk_lens[1])
        sched.update(batch, runner.run(batch))
    assert lens == [8, 8, 8, 6]
    drain(sched, runner)
    assert a.output_ids == expected_output(list(range(100, 120)), 6)
    assert b.output_ids == expected_output(list(range(200, 230)), 4)
    assert sched.allocator.num_used == 0
