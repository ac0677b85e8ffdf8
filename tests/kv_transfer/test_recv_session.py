"""The decode side's KV handoff (``kv_transfer.recv_session``) with a fake clock and fakes: every
edge of both transition tables, every deadline, keepalives, fences, and every page freed once."""

from __future__ import annotations

import pytest

from splitserve.ipc.messages import KVFailed, KVQueued
from splitserve.kv_transfer.recv_transitions import (
    RECV_TRANSITIONS,
    RECV_TRANSITIONS_ONE_SIDED,
    RecvEvent,
)
from splitserve.kv_transfer.session import IllegalTransition, TransferState
from tests.kv_transfer.session_fakes import (
    PREFILL,
    TIMEOUT_S,
    bootstrap,
    make_req,
    pages,
    recv_table,
)

T, E = TransferState, RecvEvent
DECODE_STATES = (T.QUEUED, T.WAITING_FOR_PAGES, T.KV_READY, T.FENCED)


def reserve(sessions, port, rid: str = "r1", n: int = 3):
    s = sessions.get(rid)
    page_ids = port.alloc.alloc(n)
    s.reserve(page_ids, bootstrap(rid, page_ids))
    return s


def drive(state: TransferState, one_sided: bool):
    """A session of r1 (40-token prompt, 3 pages) in ``state``: ``(session, sessions, port,
    clock)``."""
    sessions, port, clock = recv_table(one_sided)
    s = sessions.open(make_req(), PREFILL)
    if state is not T.QUEUED:
        reserve(sessions, port)
    if state is T.KV_READY:
        s.on_pages(pages("r1", s.req.page_ids, last=True), [])
    if state is T.FENCED:
        s.abort()
    assert s.state is state
    return s, sessions, port, clock


def fire(event: RecvEvent, s, sessions, port, clock) -> None:
    reserved = sorted(s.reserved)
    if event is E.RESERVE:
        reserve(sessions, port)
    elif event is E.KEEPALIVE:
        s.on_keepalive()
    elif event is E.PAGES:
        s.on_pages(pages("r1", reserved[:1]), [])
    elif event is E.LAST_PAGES:
        s.on_pages(pages("r1", reserved, last=True), [])
    elif event is E.FINISHED:
        s.on_pages(pages("r1", reserved, last=True, finished=True), [])
    elif event is E.START:
        s.start()
    elif event is E.KV_FAILED:
        s.on_kv_failed("prefill gave up")
    elif event is E.FAIL:
        s.fail("grammar failed", notify=True, error="grammar failed")
    elif event is E.ABORT:
        s.abort()
    elif event is E.RELEASED:
        s.on_released()
    elif event is E.LINK_DROPPED:
        port.drops[PREFILL] += 1
        s.check_link()
    elif event is E.TIMEOUT:
        clock.advance(TIMEOUT_S + 0.5)
        s.time_out()


CASES = [(one_sided, state, event) for one_sided in (False, True) for state in DECODE_STATES
         for event in RecvEvent if one_sided or state is not T.FENCED]


@pytest.mark.parametrize(("one_sided", "state", "event"), CASES,
                         ids=[f"{'1s' if o else '2s'}-{s.name}-{e.name}" for o, s, e in CASES])
def test_every_edge_of_the_table(one_sided, state, event) -> None:
    """Each method lands where its table says, or raises before any side effect; a page is
    freed once, and only when the session no longer holds it."""
    table = RECV_TRANSITIONS_ONE_SIDED if one_sided else RECV_TRANSITIONS
    s, sessions, port, clock = drive(state, one_sided)
    req = s.req
    sent_before = len(port.sent)
    expected = table.get((state, event))
    if expected is None and event is E.LINK_DROPPED:
        expected = state  # a poll, not an event: nothing to do outside FENCED
    if expected is None:
        with pytest.raises(IllegalTransition):
            fire(event, s, sessions, port, clock)
        assert s.state is state and len(port.sent) == sent_before
        return
    fire(event, s, sessions, port, clock)
    assert s.state is expected
    assert (s.rid in sessions) == (not expected.is_terminal)
    assert port.released[req.uid] <= 1
    if expected is T.FAILED or (event is E.FINISHED and expected is T.DONE):
        assert port.released[req.uid] == 1 and port.alloc.num_used == 0
    elif expected is T.FENCED:
        assert port.alloc.num_used == 3 and port.released[req.uid] == 0
    if expected is state:
        assert port.released[req.uid] == 0 and len(port.sent) <= sent_before + 1


def test_handoff_installs_pages_and_hands_the_request_over() -> None:
    sessions, port, clock = recv_table()
    s = sessions.open(make_req(), PREFILL)
    assert s.state is T.QUEUED and s.deadline == clock() + TIMEOUT_S
    clock.advance(1.0)
    reserve(sessions, port)
    assert [m.rid for m in port.take(type(bootstrap()))] == ["r1"]
    assert s.deadline == clock() + TIMEOUT_S  # restarted on entering the state
    s.on_pages(pages("r1", s.req.page_ids[:2]), [])
    s.on_pages(pages("r1", s.req.page_ids[2:], last=True), [])
    assert s.state is T.KV_READY and s.deadline is None  # waits for its grammar, not the peer
    assert len(port.installed) == 2
    req = s.start()
    assert s.state is T.DONE and "r1" not in sessions
    assert req.output_ids == [7] and req.kv_len == 40 and req.emitted_len == 1
    assert len(req.page_ids) == 3 and port.released[req.uid] == 0  # now the scheduler's


def test_every_message_restarts_the_receiving_deadline_and_silence_expires_it() -> None:
    sessions, port, clock = recv_table()
    s = sessions.open(make_req(), PREFILL)
    reserve(sessions, port)
    for step in range(10):  # a keepalive or a page every 2 s, longer than the timeout in all
        clock.advance(2.0)
        assert not sessions.expire(clock())
        if step % 2:
            s.on_keepalive()
        else:
            s.on_pages(pages("r1", []), [])
    clock.advance(TIMEOUT_S)
    assert not sessions.expire(clock())  # exactly at the deadline: not yet
    clock.advance(0.5)
    assert sessions.expire(clock()) == [s]
    s.time_out()
    assert s.state is T.FAILED and port.alloc.num_used == 0
    error = f"KV transfer timed out receiving KV pages after {TIMEOUT_S:g} s"
    assert port.failures == [("r1", error, 504)]
    assert port.take(KVFailed) == [KVFailed("r1", "decode worker timed out")]


def test_queued_keepalives_restart_the_deadline_only_when_delivered() -> None:
    sessions, port, clock = recv_table()
    s = sessions.open(make_req(), PREFILL)
    clock.advance(0.5)
    s.keep_alive(clock())
    assert not port.take(KVQueued)  # not a third of the timeout yet
    clock.advance(0.5)
    s.keep_alive(clock())
    assert port.take(KVQueued) == [KVQueued("r1")] and s.deadline == clock() + TIMEOUT_S
    port.unreachable = True
    deadline = s.deadline
    clock.advance(1.0)
    s.keep_alive(clock())  # not delivered: the deadline runs on
    assert s.deadline == deadline
    clock.advance(1.0)
    s.keep_alive(clock())  # a third since the failed attempt: tried again, still down
    port.unreachable = False
    clock.advance(1.5)
    assert sessions.expire(clock()) == [s]
    s.time_out()
    assert port.failures[0][1].startswith("KV transfer timed out reserving KV pages")
    assert port.failures[0][2] == 504
    assert not port.take(KVFailed)  # nothing was bootstrapped: the server aborts the prefill side


def test_queued_keepalives_stop_once_the_prefill_link_dropped() -> None:
    """The prefill worker restarted or left (with the prompt's KV): the queued request times
    out instead of being kept alive for ever."""
    sessions, port, clock = recv_table()
    s = sessions.open(make_req(), PREFILL)
    port.drops[PREFILL] += 1
    for _ in range(7):
        clock.advance(0.5)
        s.keep_alive(clock())
    assert not port.take(KVQueued) and sessions.expire(clock()) == [s]


def test_a_link_that_dropped_before_the_task_does_not_count() -> None:
    sessions, port, clock = recv_table()
    port.drops[PREFILL] = 2  # an earlier prefill worker at that address, restarted since
    s = sessions.open(make_req(), PREFILL)
    clock.advance(1.0)
    s.keep_alive(clock())
    assert port.take(KVQueued) == [KVQueued("r1")]


def test_two_sided_failure_frees_at_once_and_tells_the_prefill_side_when_asked() -> None:
    for notify, told in ((True, [KVFailed("r1", "why")]), (False, [])):
        sessions, port, _ = recv_table()
        s = sessions.open(make_req(), PREFILL)
        reserve(sessions, port)
        s.fail("why", notify=notify, error="why", code=400)
        assert s.state is T.FAILED and port.alloc.num_used == 0
        assert port.take(KVFailed) == told and port.failures == [("r1", "why", 400)]


@pytest.mark.parametrize("end", ["released", "link", "deadline"])
def test_a_fence_holds_the_pages_until_released_link_drop_or_deadline(end) -> None:
    sessions, port, clock = recv_table(one_sided=True)
    s = sessions.open(make_req(), PREFILL)
    reserve(sessions, port)
    s.abort()  # the server's abort: the prefill side is told only because the fence needs it
    assert port.take(KVFailed) == [KVFailed("r1", "aborted", ack_addr="tcp://decode")]
    assert s.state is T.FENCED and port.alloc.num_used == 3 and not port.failures
    port.sent.clear()
    # Fenced wins: late pages, keepalives, failures and aborts change nothing.
    s.on_pages(pages("r1", sorted(s.reserved), last=True), [])
    s.on_keepalive()
    s.on_kv_failed("late")
    s.abort()
    s.fail("late", notify=True, error="late")
    assert s.state is T.FENCED and not port.installed and not port.sent and not port.failures
    clock.advance(TIMEOUT_S)
    s.check_link()
    assert not sessions.expire(clock()) and port.alloc.num_used == 3
    if end == "released":
        s.on_released()
    elif end == "link":
        port.drops[PREFILL] += 1
        s.check_link()
    else:
        clock.advance(0.5)
        assert sessions.expire(clock()) == [s]
        s.time_out()
    assert s.state is T.FAILED and port.alloc.num_used == 0 and "r1" not in sessions
    assert sum(port.alloc.frees.values()) == 3


def test_a_failure_while_queued_or_ready_is_never_fenced() -> None:
    """Nothing is written before the bootstrap, nor after the last message came."""
    sessions, port, _ = recv_table(one_sided=True)
    queued = sessions.open(make_req("q"), PREFILL)
    ready = sessions.open(make_req("k"), PREFILL)
    reserve(sessions, port, "k")
    ready.on_pages(pages("k", sorted(ready.reserved), last=True), [])
    queued.abort()
    ready.fail("grammar failed", notify=True, error="grammar failed", code=400)
    assert queued.state is ready.state is T.FAILED and port.alloc.num_used == 0
    assert not port.take(KVFailed) and port.failures == [("k", "grammar failed", 400)]


def test_pages_outside_the_reservation_fail_before_anything_is_written() -> None:
    sessions, port, _ = recv_table()
    s = sessions.open(make_req(), PREFILL)
    reserve(sessions, port)
    s.on_pages(pages("r1", [50]), [])
    assert s.state is T.FAILED and not port.installed and port.alloc.num_used == 0
    error = "KV transfer failed: pages outside the request's reservation"
    assert port.failures == [("r1", error, 500)]
    assert port.take(KVFailed)[0].message.startswith("decode worker: KV transfer failed")


def test_a_bad_message_fails_the_request_with_the_receivers_error() -> None:
    sessions, port, _ = recv_table(one_sided=True)
    s = sessions.open(make_req(), PREFILL)
    reserve(sessions, port)
    port.install_error = "short frame"
    s.on_pages(pages("r1", sorted(s.reserved)[:1]), [])
    assert s.state is T.FENCED and port.failures == [("r1", "KV transfer failed: short frame", 500)]


def test_a_first_token_that_ended_the_request_frees_the_pages() -> None:
    sessions, port, _ = recv_table()
    s = sessions.open(make_req(), PREFILL)
    reserve(sessions, port)
    s.on_pages(pages("r1", [], last=True, finished=True), [])
    assert s.state is T.DONE and port.alloc.num_used == 0 and not port.failures


def test_kv_failed_from_the_prefill_side_is_reported_once() -> None:
    sessions, port, _ = recv_table()
    s = sessions.open(make_req(), PREFILL)
    reserve(sessions, port)
    s.on_kv_failed("refused by prefill worker: page_size")
    assert port.failures == [("r1", "refused by prefill worker: page_size", 500)]
    assert not port.take(KVFailed)  # it knows


def test_the_table_keeps_arrival_order_and_refuses_a_second_session_per_rid() -> None:
    sessions, port, _ = recv_table()
    for rid in ("c", "a", "b"):
        sessions.open(make_req(rid), PREFILL)
    reserve(sessions, port, "a")
    assert [s.rid for s in sessions.by_state(T.QUEUED)] == ["c", "b"]
    assert [s.rid for s in sessions] == ["c", "a", "b"] and len(sessions) == 3
    with pytest.raises(ValueError, match="already exists"):
        sessions.open(make_req("a"), PREFILL)
    assert sessions.abort("a") is not None and sessions.abort("a") is None
    assert sessions.get("a") is None and port.alloc.num_used == 0
