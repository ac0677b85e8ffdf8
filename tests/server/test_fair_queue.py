"""Deficit round robin over tenants (``server.fair_queue``), model-free and deterministic: a
burst does not queue ahead of a tenant that sends one, weights set the shares, per-tenant
order is kept, and a hypothesis run checks DRR's fairness bound against every order of
pushes, pops and removals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.server.fair_queue import FairQueue


def drain(q: FairQueue) -> list:
    out = []
    while (item := q.pop()) is not None:
        out.append(item)
    return out


def test_a_burst_does_not_queue_ahead_of_a_single_request() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(50):
        q.push("A", f"A{i}")
    q.push("B", "B0")
    order = drain(q)
    assert order.index("B0") <= 1  # served within the first two dispatches
    assert [x for x in order if x != "B0"] == [f"A{i}" for i in range(50)]


def test_without_fairness_it_is_first_come_first_served() -> None:
    q: FairQueue[str] = FairQueue(fair=False)
    for i in range(50):
        q.push("A", f"A{i}")
    q.push("B", "B0")
    assert drain(q).index("B0") == 50


def test_weights_set_the_shares() -> None:
    q: FairQueue[str] = FairQueue(weight={"A": 2.0, "B": 1.0, "C": 0.5}.__getitem__)
    for i in range(70):
        for t in "ABC":
            q.push(t, f"{t}{i}")
    first = [q.pop()[0] for _ in range(70)]  # all three backlogged throughout
    counts = {t: first.count(t) for t in "ABC"}
    assert counts == {"A": 40, "B": 20, "C": 10}


def test_remove_and_an_idle_tenant_loses_its_credit() -> None:
    q: FairQueue[str] = FairQueue(weight=lambda t: 3.0)
    a0, a1 = "a0", "a1"
    q.push("A", a0)
    q.push("A", a1)
    assert q.remove("A", a1) and not q.remove("A", a1) and not q.remove("Z", a0)
    assert len(q) == 1 and q.queued("A") == 1
    assert q.pop() == a0 and q.pop() is None and len(q) == 0
    # A spent 1 of its 3 credits, then went idle: the 2 left do not carry over.
    for i in range(3):
        q.push("A", f"A{i}")
        q.push("B", f"B{i}")
    assert drain(q) == ["A0", "A1", "A2", "B0", "B1", "B2"]


def test_heaviest_is_by_weight_and_pop_newest() -> None:
    q: FairQueue[str] = FairQueue(weight={"A": 4.0, "B": 1.0}.__getitem__)
    assert q.heaviest() is None and q.pop_newest("A") is None
    for i in range(6):
        q.push("A", f"A{i}")
    q.push("B", "B0")
    q.push("B", "B1")
    assert q.heaviest() == ("B", 2.0)  # 2 / 1 against A's 6 / 4
    assert q.backlog("A") == 1.5 and q.backlog("B", 1) == 3.0
    assert q.pop_newest("B") == "B1" and q.pop_newest("B") == "B0" and q.queued("B") == 0
    assert q.heaviest() == ("A", 1.5) and len(q) == 6
    assert drain(q) == [f"A{i}" for i in range(6)]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        FairQueue(quantum=0)
    q: FairQueue[str] = FairQueue(weight=lambda t: 0.0)
    with pytest.raises(ValueError, match="weight"):
        q.push("A", "x")
    with pytest.raises(ValueError, match="cost"):
        FairQueue().push("A", "x", cost=0)


WEIGHTS = {"A": 1.0, "B": 2.0, "C": 0.5}
ops = st.lists(st.one_of(
    st.tuples(st.just("push"), st.sampled_from(sorted(WEIGHTS)), st.integers(1, 5)),
    st.tuples(st.just("pop")),
    st.tuples(st.just("remove"), st.sampled_from(sorted(WEIGHTS)), st.integers(0, 9)),
), max_size=120)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_fifo_per_tenant_each_item_once_and_drr_bound(script) -> None:
    q: FairQueue[tuple[str, int]] = FairQueue(weight=WEIGHTS.__getitem__)
    model: dict[str, list[tuple[str, int]]] = {t: [] for t in WEIGHTS}
    # (t, u) -> items served to t while t and u were both backlogged, since they last were not.
    together: dict[tuple[str, str], int] = {(t, u): 0 for t in WEIGHTS for u in WEIGHTS}
    seq = 0
    for op in script:
        if op[0] == "push":
            for _ in range(op[2]):
                item = (op[1], seq)
                seq += 1
                q.push(op[1], item)
                model[op[1]].append(item)
        elif op[0] == "remove":
            backlog = model[op[1]]
            if backlog:
                item = backlog[op[2] % len(backlog)]
                assert q.remove(op[1], item)
                backlog.remove(item)
        else:
            busy = {t for t, b in model.items() if b}
            item = q.pop()
            if not busy:
                assert item is None
                continue
            tenant = item[0]
            assert item == model[tenant].pop(0)  # FIFO within a tenant
            for u in busy:
                together[tenant, u] += 1
            # DRR: over a stretch where two tenants are both backlogged, their service divided
            # by their weights differs by at most about one item and one quantum each
            # (Shreedhar & Varghese, Theorem 1).
            for t in busy:
                for u in busy:
                    gap = together[t, u] / WEIGHTS[t] - together[u, t] / WEIGHTS[u]
                    assert gap <= 2 + 1 / WEIGHTS[t] + 1 / WEIGHTS[u], (t, u, together)
        for (t, u) in together:
            if not model[t] or not model[u]:
                together[t, u] = 0
        assert len(q) == sum(map(len, model.values()))
