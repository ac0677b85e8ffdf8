"""The router's admission gate (``server.admission``) on a fake clock, with no event loop and no
workers: slots, the fair queue in front of them, the 429 past the queue's cap and its
``Retry-After`` estimate, the pass-through when no worker is left; and the ZeroMQ client's
wrapper that waits on it (``ZmqEngineClient._admitted``), driven by events only."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from splitserve.server.admission import (
    MAX_RETRY_AFTER_S,
    AdmissionGate,
    Overload,
    Ticket,
    lanes,
    retry_headers,
)
from splitserve.server.engine_client import TokenEvent
from splitserve.server.fair_queue import FairQueue


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def gate_with(slots: int, waiting: int, fair: bool = True, clock=None) -> AdmissionGate:
    box = {"slots": slots, "waiting": waiting}
    gate = AdmissionGate(lambda: box["slots"], lambda: box["waiting"],
                         lambda: FairQueue(fair=fair), clock or Clock())
    gate.box = box  # type: ignore[attr-defined]  # the test changes capacity through it
    return gate


def enter(gate: AdmissionGate, tenant: str, name: str, woken: list[str],
          priority: int = 0) -> Ticket:
    ticket = gate.enter(tenant, lambda: woken.append(name), priority)
    assert isinstance(ticket, Ticket)
    return ticket


@pytest.mark.parametrize("fair", [True, False])
def test_tenant_b_is_served_within_two_dispatches_of_a_burst(fair) -> None:
    gate = gate_with(slots=1, waiting=1000, fair=fair)
    woken: list[str] = []
    running = enter(gate, "X", "X0", woken)  # holds the only slot
    assert running.admitted and woken == []
    tickets = {f"A{i}": enter(gate, "A", f"A{i}", woken) for i in range(50)}
    tickets["B0"] = enter(gate, "B", "B0", woken)
    assert gate.waiting == 51 and not any(t.admitted for t in tickets.values())
    order = []
    current = running
    while gate.waiting:  # one dispatch per request that ends
        gate.leave(current)
        order.append(woken[-1])
        current = tickets[woken[-1]]
    assert order.index("B0") == (1 if fair else 50)
    assert gate.in_use == 1 and gate.num_queued == 51


def test_queue_cap_refuses_with_a_retry_after_from_the_hold_time() -> None:
    clock = Clock()
    gate = gate_with(slots=2, waiting=4, clock=clock)
    woken: list[str] = []
    first = [enter(gate, "A", f"R{i}", woken) for i in range(2)]
    clock.now += 10.0
    gate.leave(first[0])  # held 10 s: the first hold time measured
    assert gate.hold_s == pytest.approx(10.0)
    enter(gate, "A", "R2", woken)
    waiting = [enter(gate, "A", f"W{i}", woken) for i in range(4)]
    refusal = gate.enter("A", lambda: woken.append("never"))  # A has the longest queue
    assert isinstance(refusal, Overload) and "4 waiting (limit 4)" in refusal.message
    # 4 waiting, 10 s per request, 2 slots: through in about 20 s.
    assert refusal.retry_after_s == pytest.approx(20.0) and gate.num_refused == 1
    assert gate.waiting == 4 and not any(t.admitted for t in waiting)
    # A refusal holds nothing, and the estimate stays within what clients honour.
    gate.hold_s = 1e6
    assert gate.retry_after_s() == MAX_RETRY_AFTER_S
    gate.hold_s = 0.0
    assert gate.retry_after_s() == 1.0
    assert retry_headers(20.0) == {"Retry-After": "20", "retry-after-ms": "20000"}
    assert retry_headers(0.2) == {"Retry-After": "1", "retry-after-ms": "200"}


@pytest.mark.parametrize("fair", [True, False])
def test_a_full_queue_drops_the_heaviest_tenants_newest(fair) -> None:
    gate = gate_with(slots=1, waiting=4, fair=fair)
    woken: list[str] = []
    enter(gate, "A", "A0", woken)
    a = [enter(gate, "A", f"A{i}", woken) for i in range(1, 5)]  # the flood fills the queue
    b = gate.enter("B", lambda: woken.append("B1"))
    if not fair:  # one queue: the newcomer is refused (tail drop)
        assert isinstance(b, Overload) and woken == [] and gate.waiting == 4
        return
    # B waits in place of A's newest, which is woken with a refusal; then B is served next.
    assert isinstance(b, Ticket) and not b.admitted and gate.waiting == 4
    assert woken == ["A4"] and a[3].refusal is not None and a[3].left and not a[3].admitted
    assert gate.num_refused == 1
    gate.leave(a[3])  # its stream ends: nothing more to free
    assert gate.waiting == 4
    b2 = gate.enter("B", lambda: woken.append("B2"))  # B: 2 < A's 3: A3 goes too
    assert isinstance(b2, Ticket) and woken == ["A4", "A3"]
    refused = gate.enter("B", lambda: woken.append("B3"))  # B: 3 is not < A's 2
    assert isinstance(refused, Overload) and gate.num_refused == 3


@pytest.mark.parametrize("fair", [True, False])
def test_a_more_urgent_request_is_admitted_before_every_less_urgent_one(fair) -> None:
    gate = gate_with(slots=1, waiting=100, fair=fair)
    woken: list[str] = []
    current = enter(gate, "X", "X0", woken)
    tickets = {f"A{i}": enter(gate, "A", f"A{i}", woken) for i in range(3)}
    tickets["B0"] = enter(gate, "B", "B0", woken)
    # The first urgent one borrows the slot of X0, which is less urgent (a worker preempts
    # X0 for it if it must); the next must wait: X0's slot is lent already.
    lent = enter(gate, "A", "H0", woken, priority=-1)
    assert lent.admitted and gate.in_use == 2 and woken == []
    tickets["H1"] = enter(gate, "C", "H1", woken, priority=-1)
    tickets["L0"] = enter(gate, "C", "L0", woken, priority=5)
    assert not tickets["H1"].admitted and gate.waiting == 6
    gate.leave(current)  # the lent slot comes back first: nobody is admitted yet
    assert woken == [] and gate.in_use == 1
    current = lent
    order = []
    while gate.waiting:
        gate.leave(current)
        order.append(woken[-1])
        current = tickets[woken[-1]]
    assert order[0] == "H1" and order[-1] == "L0"
    # Inside class 0 the tenants still share by deficit round robin (or FIFO when not fair).
    assert order[1:-1] == (["A0", "B0", "A1", "A2"] if fair else ["A0", "A1", "A2", "B0"])
    assert gate.in_use == 1


def test_an_urgent_request_borrows_at_most_one_slot_per_less_urgent_running_one() -> None:
    gate = gate_with(slots=2, waiting=100)
    woken: list[str] = []
    low = [enter(gate, "A", f"A{i}", woken, priority=3) for i in range(2)]
    urgent = [enter(gate, "B", f"H{i}", woken, priority=0) for i in range(3)]
    assert [t.admitted for t in urgent] == [True, True, False] and gate.in_use == 4
    assert gate.lending
    # Nothing running is less urgent than another priority-3 request: it waits; and with
    # twice the slots in use nothing more is lent, however urgent.
    assert not enter(gate, "A", "A2", woken, priority=3).admitted
    assert not enter(gate, "C", "H9", woken, priority=-1).admitted
    for t in low:
        gate.leave(t)
    assert woken == [] and gate.in_use == 2  # still at the slots: the lent ones came back
    assert not gate.lending
    gate.leave(urgent[0])
    assert woken == ["H9"]  # the most urgent class first


@pytest.mark.parametrize("fair", [True, False])
def test_a_full_queue_gives_a_less_urgent_place_to_a_more_urgent_arrival(fair) -> None:
    gate = gate_with(slots=1, waiting=3, fair=fair)
    woken: list[str] = []
    enter(gate, "X", "X0", woken, priority=-5)  # nothing to borrow from: it is more urgent
    low = enter(gate, "A", "L0", woken, priority=1)
    a = [enter(gate, "A", f"A{i}", woken) for i in range(2)]
    urgent = gate.enter("B", lambda: woken.append("H0"), -1)
    # The least urgent class gives its place, whatever the tenants' backlogs.
    assert isinstance(urgent, Ticket) and not urgent.admitted
    assert woken == ["L0"] and low.refusal is not None
    urgent2 = gate.enter("B", lambda: woken.append("H1"), -1)
    assert isinstance(urgent2, Ticket) and woken == ["L0", "A1"] and a[1].refusal is not None
    # Nothing less urgent than the arrival's own class waits now: a lower one is refused,
    # and so is one of class 0 that is not lighter than A there (fair), or any (FIFO).
    assert isinstance(gate.enter("C", lambda: None, 3), Overload)
    assert isinstance(gate.enter("A", lambda: None, 0), Overload)
    assert gate.waiting == 3 and gate.num_refused == 4
    gate.leave(a[0])  # leaving while waiting frees the place in its own class
    assert gate.waiting == 2 and len(gate.queue) == 2 and gate.queue.least_urgent() == -1


def test_no_queue_means_refused_at_once_past_the_slots() -> None:
    gate = gate_with(slots=1, waiting=0)
    woken: list[str] = []
    enter(gate, "A", "A0", woken)
    assert isinstance(gate.enter("A", lambda: None), Overload)


def test_leaving_while_waiting_gives_the_place_back_and_leave_is_idempotent() -> None:
    gate = gate_with(slots=1, waiting=10)
    woken: list[str] = []
    running = enter(gate, "A", "A0", woken)
    gone = enter(gate, "B", "B0", woken)
    stays = enter(gate, "C", "C0", woken)
    gate.leave(gone)  # its client left while it waited
    gate.leave(gone)
    assert gate.waiting == 1 and gate.in_use == 1
    gate.leave(running)
    gate.leave(running)  # a second leave frees nothing more
    assert woken == ["C0"] and stays.admitted and gate.in_use == 1


def test_a_request_waiting_past_the_deadline_is_refused_once() -> None:
    clock = Clock()
    gate = gate_with(slots=1, waiting=10, clock=clock)
    woken: list[str] = []
    running = enter(gate, "A", "A0", woken)
    late = enter(gate, "B", "B0", woken)
    keeps = enter(gate, "C", "C0", woken)
    clock.now += 30.0
    refusal = gate.expire(late, 30.0)
    assert isinstance(refusal, Overload) and refusal.retry_after_s >= 1.0
    assert refusal.message.startswith("server overloaded: waited 30.0 s for one of 1 slots "
                                      "(limit 30 s, --max-queue-wait)"), refusal.message
    assert gate.waiting == 1 and gate.num_expired == 1 and gate.num_refused == 0
    assert gate.expire(late, 30.0) is None and gate.num_expired == 1  # once only
    assert gate.expire(running, 30.0) is None  # running: not waiting, nothing changes
    gate.leave(running)
    assert woken == ["C0"] and keeps.admitted and not late.admitted
    assert gate.expire(keeps, 30.0) is None and gate.in_use == 1  # admitted in the meantime


def test_no_worker_left_lets_everyone_through_to_their_503() -> None:
    gate = gate_with(slots=1, waiting=10)
    woken: list[str] = []
    enter(gate, "A", "A0", woken)
    waiters = [enter(gate, "A", f"A{i}", woken) for i in range(1, 4)]
    gate.box["slots"] = 0  # every worker died: no slot will ever free
    assert gate.dispatch() == waiters and woken == ["A1", "A2", "A3"]
    assert enter(gate, "B", "B0", woken).admitted  # a new one goes straight on, too


def test_capacity_that_grows_is_used_by_the_next_arrival() -> None:
    gate = gate_with(slots=1, waiting=10)
    woken: list[str] = []
    enter(gate, "A", "A0", woken)
    enter(gate, "A", "A1", woken)
    gate.box["slots"] = 3  # a worker joined
    late = enter(gate, "B", "B0", woken)
    assert woken == ["A1"] and late.admitted and gate.in_use == 3


def test_metrics_read_the_gate() -> None:
    from prometheus_client.exposition import generate_latest

    from splitserve.server.metrics import ServerMetrics

    gate = gate_with(slots=1, waiting=1)
    woken: list[str] = []
    enter(gate, "A", "A0", woken)
    waiting = enter(gate, "A", "A1", woken)
    assert isinstance(gate.enter("B", lambda: None), Overload)
    assert isinstance(gate.expire(waiting, 1.0), Overload)
    metrics = ServerMetrics()
    metrics.attach_gate(gate)
    text = generate_latest(metrics.registry).decode()
    for line in ("splitserve_router_slots_in_use 1.0", "splitserve_router_queue_waiting 0.0",
                 "splitserve_router_queued_total 0.0", "splitserve_router_queue_refused_total 1.0",
                 "splitserve_router_queue_expired_total 1.0"):
        assert line in text, text


@dataclass
class W:
    role: str
    ready: bool = True
    draining: bool = False


def test_lanes() -> None:
    assert lanes([]) == 0
    assert lanes([W("colocated"), W("colocated", ready=False)]) == 1
    assert lanes([W("prefill"), W("decode"), W("decode")]) == 1
    assert lanes([W("prefill"), W("prefill"), W("decode"), W("decode", draining=True)]) == 1
    assert lanes([W("prefill"), W("decode", ready=False)]) == 0


def test_client_waits_in_the_gate_and_refuses_past_it(tmp_path) -> None:
    from splitserve.server.worker_client import ZmqEngineClient

    async def main() -> None:
        client = ZmqEngineClient(f"ipc://{tmp_path}/inbox")
        client.gate = AdmissionGate(lambda: 1, lambda: 1)
        started: list[str] = []
        release = {name: asyncio.Event() for name in ("r0", "r1")}

        async def inner(name: str):
            started.append(name)
            await release[name].wait()
            yield TokenEvent([1], [0.0], "stop")

        try:
            first = client._admitted("A", inner("r0"))
            second = client._admitted("B", inner("r1"))
            third = client._admitted("C", inner("r2"))
            t1 = asyncio.ensure_future(first.__anext__())
            t2 = asyncio.ensure_future(second.__anext__())
            for _ in range(100):  # event-loop turns (no time passes) until both reached it
                if client.gate.waiting and started:
                    break
                await asyncio.sleep(0)
            assert started == ["r0"] and client.gate.in_use == 1 and client.gate.waiting == 1
            refused = await third.__anext__()  # one running, one waiting: the queue is full
            assert refused.error_code == 429 and refused.retry_after_s >= 1.0
            assert started == ["r0"]  # the refused one never started
            release["r0"].set()
            assert (await t1).finish_reason == "stop"
            # Its last event gave its slot to the waiting one (no aclose needed).
            assert client.gate.in_use == 1 and client.gate.waiting == 0
            release["r1"].set()
            assert (await t2).finish_reason == "stop" and started == ["r0", "r1"]
            assert client.gate.in_use == 0 and client.gate.waiting == 0
            await first.aclose()
            await second.aclose()
            assert client.gate.num_admitted == 2 and client.gate.num_refused == 1
        finally:
            await client.close()

    asyncio.run(main())


def one_event_streams(started: list[str]):
    """A request's stream by name: it records the name when it starts, then ends with one
    event."""

    async def inner(name: str):
        started.append(name)
        yield TokenEvent([1], [0.0], "stop")

    return inner


def test_client_answers_429_to_a_waiting_request_pushed_out(tmp_path) -> None:
    from splitserve.server.worker_client import ZmqEngineClient

    async def main() -> None:
        client = ZmqEngineClient(f"ipc://{tmp_path}/inbox")
        client.gate = AdmissionGate(lambda: 1, lambda: 2)
        started: list[str] = []
        inner = one_event_streams(started)

        try:
            running = client.gate.enter("A", lambda: None)  # holds the only slot
            streams = {n: client._admitted(t, inner(n)) for t, n in
                       (("A", "a1"), ("A", "a2"), ("B", "b1"))}
            nexts = {}
            for name in ("a1", "a2", "b1"):  # each reaches the gate before the next starts
                nexts[name] = asyncio.ensure_future(streams[name].__anext__())
                for _ in range(100):  # event-loop turns, no time passes
                    if client.gate.num_admitted + client.gate.waiting == len(nexts) + 1:
                        break
                    await asyncio.sleep(0)
            refused = await nexts["a2"]  # b1 took the place of A's newest in the full queue
            assert refused.error_code == 429 and refused.retry_after_s >= 1.0
            assert client.gate.waiting == 2 and started == []
            client.gate.leave(running)  # DRR: a1 (A's turn), then b1
            assert (await nexts["a1"]).finish_reason == "stop"
            assert (await nexts["b1"]).finish_reason == "stop" and started == ["a1", "b1"]
            for stream in streams.values():
                await stream.aclose()
            assert client.gate.in_use == 0 and client.gate.waiting == 0
        finally:
            await client.close()

    asyncio.run(main())


def test_client_refuses_a_request_that_waits_past_max_queue_wait(tmp_path) -> None:
    """``max_queue_wait_s``: a request still waiting for a slot when it runs out is answered
    429 (never started, its place given back); one admitted before it runs out is not
    touched. The deadline is the only timer; the assertions wait on the events it ends."""
    from splitserve.server.worker_client import ZmqEngineClient

    async def main() -> None:
        client = ZmqEngineClient(f"ipc://{tmp_path}/inbox", max_queue_wait_s=0.05)
        client.gate = AdmissionGate(lambda: 1, lambda: 4)
        started: list[str] = []
        inner = one_event_streams(started)

        try:
            running = client.gate.enter("A", lambda: None)  # holds the only slot
            late = client._admitted("B", inner("late"))
            refused = await late.__anext__()
            assert refused.error_code == 429 and "--max-queue-wait" in refused.error
            assert refused.retry_after_s >= 1.0 and started == []
            assert client.gate.waiting == 0 and client.gate.num_expired == 1
            await late.aclose()
            client.max_queue_wait_s = 30.0
            on_time = client._admitted("C", inner("on_time"))
            event = asyncio.ensure_future(on_time.__anext__())
            for _ in range(100):  # event-loop turns, no time passes
                if client.gate.waiting:
                    break
                await asyncio.sleep(0)
            client.gate.leave(running)  # admitted long before its deadline
            assert (await event).finish_reason == "stop" and started == ["on_time"]
            await on_time.aclose()
            assert client.gate.in_use == 0 and client.gate.num_expired == 1
        finally:
            await client.close()

    asyncio.run(main())


def test_max_queue_wait_flag() -> None:
    from tests.server.test_small_endpoints import parse_server_flags

    assert parse_server_flags([]).server.max_queue_wait_s == 600.0
    assert parse_server_flags(["--max-queue-wait", "2.5"]).server.max_queue_wait_s == 2.5
    with pytest.raises(ValueError, match="max_queue_wait_s"):
        parse_server_flags(["--max-queue-wait", "-1"]).server.check()


def test_the_gate_keeps_no_count_for_priorities_no_longer_running() -> None:
    # Any int32 may come as a priority: the per-priority counts must not grow with them.
    gate = gate_with(slots=2, waiting=4)
    holder = enter(gate, "A", "A0", [], priority=10)
    for p in range(-1000, 1000, 7):
        t = gate.enter("B", lambda: None, p)
        if isinstance(t, Ticket):
            gate.leave(t)
    assert gate._running == {10: 1} and gate.in_use == 1 and gate.waiting == 0
    gate.leave(holder)
    assert not gate._running and gate.in_use == 0
