"""The LoRA slots' bookkeeping (``engine.lora.slots``), no tensors: LRU eviction of idle
unpinned slots, pins, drains for waiting adapters, retirement; and a hypothesis state machine
whose invariants are that a slot in use or pinned is never overwritten and that an acquisition
fails only when no slot could take the adapter."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from splitserve.engine.lora.slots import LoraSlots

NAMES = ["a", "b", "c", "d", "e"]


class Recorder:
    """The slots' installs and clears, as the model's tables would see them."""

    def __init__(self, n: int) -> None:
        self.content: list[str | None] = [None] * n
        self.installs = 0

    def install(self, name: str):
        def put(slot: int) -> None:
            assert self.content[slot] is None, "installed over a slot not cleared"
            self.content[slot] = name
            self.installs += 1
        return put

    def clear(self, slot: int) -> None:
        self.content[slot] = None


def make(n: int) -> tuple[LoraSlots, Recorder]:
    rec = Recorder(n)
    return LoraSlots(n, rec.clear), rec


def test_lru_evicts_the_least_recently_used_idle_slot() -> None:
    slots, rec = make(2)
    a = slots.acquire("a", rec.install("a"))
    b = slots.acquire("b", rec.install("b"))
    assert slots.acquire("c", rec.install("c")) is None  # both in use
    slots.release(a)
    slots.release(b)
    assert slots.acquire("a", rec.install("a")) == a  # resident: no install
    slots.release(a)  # a used after b: b is the LRU
    c = slots.acquire("c", rec.install("c"))
    assert c == b and rec.content == ["a", "c"] and slots.num_evictions == 1
    assert rec.installs == 3


def test_pinned_slots_are_never_evicted() -> None:
    slots, rec = make(2)
    p = slots.pin("p", rec.install("p"))
    assert p is not None
    assert slots.pin("q", rec.install("q")) is None  # one slot stays unpinned
    for name in NAMES:
        s = slots.acquire(name, rec.install(name))
        assert s is not None and s != p
        slots.release(s)
    assert rec.content[p] == "p"
    assert slots.acquire("p", rec.install("p")) == p  # still served from its slot


def test_a_waiting_adapter_drains_the_lru_slot_then_gets_it() -> None:
    slots, rec = make(1)
    a1 = slots.acquire("a", rec.install("a"))
    assert slots.acquire("b", rec.install("b")) is None
    slots.want({"b"})  # a request for b waits: a takes no new request
    assert slots.acquire("a", rec.install("a")) is None
    slots.release(a1)
    assert slots.acquire("b", rec.install("b")) == 0 and rec.content == ["b"]
    slots.want(set())  # nobody waits: nothing drains
    assert slots.slots[0].draining is False


def test_a_drain_ends_when_nobody_waits_any_more() -> None:
    slots, rec = make(1)
    a = slots.acquire("a", rec.install("a"))
    slots.want({"b"})
    slots.release(a)
    slots.want(set())  # b's request went away before it got the slot
    assert slots.acquire("a", rec.install("a")) == 0


def test_retired_adapters_empty_with_their_last_reference() -> None:
    slots, rec = make(2)
    a = slots.acquire("a", rec.install("a"))
    slots.retire("a")
    assert rec.content[a] == "a"  # its request still runs under it
    slots.release(a)
    assert rec.content[a] is None and slots.resident() == []


class SlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.n = 3
        self.slots, self.rec = make(self.n)
        self.held: list[tuple[int, str]] = []
        self.pinned: dict[str, int] = {}

    @rule(name=st.sampled_from(NAMES))
    def acquire(self, name: str) -> None:
        before = [(None if s.retired else s.adapter, s.refs, s.pinned, s.draining)
                  for s in self.slots.slots]
        olds = list(self.slots.slots)
        slot = self.slots.acquire(name, self.rec.install(name))
        if slot is not None:
            self.held.append((slot, name))
            return
        own = [i for i, (a, _, _, _) in enumerate(before) if a == name]
        if own:
            assert before[own[0]][3], "a resident adapter refused though its slot is not draining"
        else:
            assert all((a is not None or r.retired) and (refs > 0 or pinned)
                       for (a, refs, pinned, _), r in zip(before, olds, strict=True)), \
                "refused though a slot was empty or idle and unpinned"

    @precondition(lambda self: self.held)
    @rule(i=st.integers(min_value=0))
    def release(self, i: int) -> None:
        slot, _ = self.held.pop(i % len(self.held))
        self.slots.release(slot)

    @rule(names=st.sets(st.sampled_from(NAMES), max_size=2))
    def want(self, names: set[str]) -> None:
        self.slots.want(names)

    @rule(name=st.sampled_from(NAMES))
    def pin(self, name: str) -> None:
        slot = self.slots.pin(name, self.rec.install(name))
        if slot is not None:
            self.pinned[name] = slot

    @rule(name=st.sampled_from(NAMES))
    def retire(self, name: str) -> None:
        self.slots.retire(name)
        self.pinned.pop(name, None)

    @invariant()
    def slots_in_use_keep_their_adapter(self) -> None:
        for slot, name in self.held:
            assert self.rec.content[slot] == name
        for slot in range(self.n):
            refs = sum(1 for s, _ in self.held if s == slot)
            assert self.slots.slots[slot].refs == refs

    @invariant()
    def pinned_adapters_stay(self) -> None:
        for name, slot in self.pinned.items():
            assert self.rec.content[slot] == name and self.slots.slots[slot].pinned
        assert sum(s.pinned for s in self.slots.slots) < self.n

    @invariant()
    def tables_match_the_books(self) -> None:
        assert self.rec.content == [s.adapter for s in self.slots.slots]


SlotMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_slot_machine = SlotMachine.TestCase
