"""The scheduler's KV handoff states with no model: requests whose KV is coming
(``WAITING_FOR_KV``) are admitted by ``can_admit`` in arrival order and hold their reserved
pages until received or released; prefilled requests (``SENDING_KV``) hold theirs until
released; a received request's first token is replayed, checked for the end and jumped from
once, in the scheduler. Plus a hypothesis state machine: every page is accounted for in every
state, and admission never passes a request that arrived earlier."""

from __future__ import annotations

from collections import deque

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from splitserve.engine.kv_pool import pages_for
from splitserve.engine.sched.request import Req
from splitserve.engine.sched.scheduler import Received
from tests.engine.test_scheduler import PAGE, FakeRunner, expected_output, make, req, step


class Grammar:
    """Accepts all but ``refuse``; forces ``forced`` once; complete after ``end_after``
    accepted tokens (None: never)."""

    def __init__(self, refuse=(), forced=(), end_after=None) -> None:
        self.refuse, self.forced, self.end_after = set(refuse), list(forced), end_after
        self.accepted: list[int] = []

    def accept(self, token: int) -> bool:
        if token in self.refuse:
            return False
        self.accepted.append(token)
        return True

    def must_end(self) -> bool:
        return self.end_after is not None and len(self.accepted) >= self.end_after

    def forced_tokens(self, limit: int) -> list[int]:
        forced, self.forced = self.forced[:limit], []
        return forced

    def accepted_prefix(self, draft: list[int]) -> int:
        return len(draft)


def receive(r: Req) -> None:
    """What the KV transfer does to an admitted request: its prompt's KV is in its pages, and
    the prefill worker's first token is its one output without KV."""
    r.append_output(FakeRunner.next_token(r.input_ids), -0.5)
    r.kv_len = r.prompt_len
    r.emitted_len = 1


def test_admission_in_arrival_order_by_can_admit() -> None:
    sched, _ = make(num_pages=8)  # 7 usable pages
    a, b, c, d = req("a", 9, 4), req("b", 9, 4), req("c", 9, 4), req("d", 2, 4)
    for r in (a, b, c, d):
        sched.add_waiting_for_kv(r)
    assert sched.allocator.num_used == 0  # nothing reserved before admission
    assert sched.admit_waiting_for_kv() == [a, b]  # 3 pages each; c does not fit
    assert list(sched.waiting_for_kv) == [c, d]  # d fits, but waits behind c
    assert a.page_ids and sched.receiving_kv == [a, b]
    sched.check_pages()
    assert sched.admit_waiting_for_kv() == []
    sched.release(a)  # its transfer failed
    assert a.page_ids == [] and sched.admit_waiting_for_kv() == [c, d]
    sched.check_pages()
    for r in (b, c, d):
        sched.release(r)
    assert sched.allocator.num_used == 0 and not sched.receiving_kv


def test_a_received_request_runs_and_decodes_its_output() -> None:
    sched, runner = make()
    r = req("a", 9, 5)
    sched.add_waiting_for_kv(r)
    sched.admit_waiting_for_kv()
    receive(r)
    assert sched.add_received(r) is Received.RUNNING and sched.running == [r]
    while sched.has_work:
        step(sched, runner)
    assert r.output_ids == expected_output(r.input_ids, 5)
    assert sched.allocator.num_used == 0


def test_a_received_constrained_request_replays_its_first_token() -> None:
    sched, _ = make()
    refused, ended, jumps = req("a", 9, 5), req("b", 9, 5), req("c", 9, 5)
    refused.grammar = Grammar(refuse={FakeRunner.next_token(refused.input_ids)})
    ended.grammar = Grammar(end_after=1)
    jumps.grammar = Grammar(forced=[70, 71])
    for r in (refused, ended, jumps):
        sched.add_waiting_for_kv(r)
    sched.admit_waiting_for_kv()
    for r in (refused, ended, jumps):
        receive(r)
    assert sched.add_received(refused) is Received.REFUSED and refused.page_ids == []
    assert sched.add_received(ended) is Received.FINISHED and ended.finish_reason == "stop"
    assert sched.add_received(jumps) is Received.RUNNING
    assert jumps.output_ids[1:] == [70, 71] and jumps.extend_len == 3
    sched.check_pages()
    assert sched.allocator.num_used == len(jumps.page_ids)


def test_a_prefilled_request_holds_its_pages_until_released() -> None:
    sched, runner = make(prefill_only=True)
    r = req("a", 9, 5)
    sched.add(r)
    (out,) = step(sched, runner)
    assert out.prefilled and sched.sending_kv == [r] and not sched.has_work
    sched.check_pages()
    assert sched.allocator.num_used == pages_for(10, PAGE)
    sched.release(r)
    assert not sched.sending_kv and sched.allocator.num_used == 0


class KVStatesMachine(RuleBasedStateMachine):
    """Requests whose KV is coming, arriving, received, failed (released) at random, and steps
    of the requests that run: admission stays in arrival order, a request that did not fit
    blocks those behind it, and every page is the cache's or one request's."""

    def __init__(self) -> None:
        super().__init__()
        self.sched, self.runner = make(num_pages=16, max_batch_tokens=16, max_running=4)
        self.queued: deque[Req] = deque()  # the reference: arrival order, not admitted yet
        self.admitted: list[Req] = []
        self.n = 0

    @rule(prompt_len=st.integers(1, 24), max_new=st.integers(1, 8))
    def expect(self, prompt_len: int, max_new: int) -> None:
        if pages_for(prompt_len + max_new, PAGE) > 15:
            return  # never fits: the worker refuses it
        r = req(f"r{self.n}", prompt_len, max_new, start=7 * self.n)
        self.n += 1
        self.sched.add_waiting_for_kv(r)
        self.queued.append(r)

    @rule()
    def admit(self) -> None:
        for r in self.sched.admit_waiting_for_kv():
            assert r is self.queued.popleft(), "admitted out of arrival order"
            assert len(r.page_ids) == pages_for(r.prompt_len, PAGE)
            self.admitted.append(r)
        if self.queued:
            head = self.queued[0]
            assert not self.sched.can_admit(pages_for(head.prompt_len, PAGE))

    @precondition(lambda self: self.admitted)
    @rule(data=st.data())
    def arrive(self, data) -> None:
        r = data.draw(st.sampled_from(self.admitted))
        self.admitted.remove(r)
        receive(r)
        if r.check_finished(self.sched.eos_token_ids):
            self.sched.release(r)  # the first token ended it: its session frees it
            return
        assert self.sched.add_received(r) is Received.RUNNING and r in self.sched.running

    @precondition(lambda self: self.admitted or self.queued)
    @rule(data=st.data())
    def fail(self, data) -> None:
        r = data.draw(st.sampled_from([*self.admitted, *self.queued]))
        (self.admitted if r in self.admitted else self.queued).remove(r)
        self.sched.release(r)
        assert r.page_ids == []

    @rule()
    def step(self) -> None:
        step(self.sched, self.runner)

    @invariant()
    def pages_accounted(self) -> None:
        self.sched.check_pages()
        assert list(self.sched.waiting_for_kv) == list(self.queued)
        assert set(map(id, self.sched.receiving_kv)) == set(map(id, self.admitted))

    def teardown(self) -> None:
        for r in [*self.admitted, *self.queued]:
            self.sched.release(r)
        for _ in range(1000):
            if not self.sched.has_work:
                break
            for out in step(self.sched, self.runner):
                if out.finished:
                    r = out.req
                    assert r.output_ids == expected_output(r.input_ids,
                                                           r.sampling.max_new_tokens)
        assert not self.sched.has_work and self.sched.allocator.num_used == 0


TestKVStatesMachine = KVStatesMachine.TestCase
TestKVStatesMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
