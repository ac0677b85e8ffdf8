"""The prefill side's KV handoff (``kv_transfer.send_session``) with a fake clock and fakes: every
edge of its transition table, every deadline, keepalives, acknowledgements, and every page freed
once."""

from __future__ import annotations

import pytest

from splitserve.ipc.messages import KVFailed, KVKeepalive, KVReleased
from splitserve.ipc.sockets import PeerUnreachable
from splitserve.kv_transfer.send_transitions import SEND_TRANSITIONS, SendEvent
from splitserve.kv_transfer.session import IllegalTransition, TransferState
from tests.kv_transfer.session_fakes import DECODE, TIMEOUT_S, bootstrap, make_req, send_table

T, E = TransferState, SendEvent
PREFILL_STATES = (T.WAITING_FOR_TASK, T.BOOTSTRAPPING, T.PREFILLED, T.TRANSFERRING, T.DRAINING,
                  T.RELEASING)


def computed_req(port, rid: str = "r1", kv_len: int = 40, first_token: bool = True):
    """A 40-token prompt (3 pages) as the scheduler leaves it: ``kv_len`` tokens computed, and
    its first token sampled (``first_token``)."""
    req = make_req(rid)
    req.page_ids = port.alloc.alloc(3)
    req.kv_len = kv_len
    if first_token:
        req.output_ids.append(5)
        req.output_logprobs.append(-0.1)
    return req


def drive(state: TransferState):
    """A session of r1 in ``state`` whose backend still reads its pages: ``(session, sessions,
    port, sender, clock)``."""
    sessions, port, sender, clock = send_table()
    sender.busy.add("r1")
    if state is T.WAITING_FOR_TASK:
        s = sessions.open_bootstrap(bootstrap())
    else:
        s = sessions.open_task(computed_req(port))
    if state is T.PREFILLED:
        s.on_prefilled()
    if state in (T.TRANSFERRING, T.DRAINING):
        s.on_bootstrap(bootstrap())
    if state is T.DRAINING:
        s.on_prefilled()
    if state is T.RELEASING:
        s.on_kv_failed(DECODE)
    assert s.state is state
    return s, sessions, port, sender, clock


def fire(event: SendEvent, s, sessions, port, sender, clock) -> None:
    if event is E.TASK:
        s.on_task(computed_req(port))
    elif event is E.BOOTSTRAP:
        s.on_bootstrap(bootstrap())
    elif event is E.QUEUED:
        s.on_queued()
    elif event is E.PAGES_COMPUTED:
        s.send_computed_pages()
    elif event is E.PREFILLED:
        s.on_prefilled()
    elif event is E.DRAINED:
        sender.busy.clear()
        s.poll()
    elif event is E.KV_FAILED:
        s.on_kv_failed()
    elif event is E.KV_FAILED_ACK:
        s.on_kv_failed(DECODE)
    elif event is E.FAIL:
        s.fail("grammar failed", 400, notify="grammar failed")
    elif event is E.ABORT:
        s.abort()
    elif event is E.TIMEOUT:
        clock.advance(TIMEOUT_S + 0.5)
        s.time_out()


CASES = [(state, event) for state in PREFILL_STATES for event in SendEvent]


@pytest.mark.parametrize(("state", "event"), CASES, ids=[f"{s.name}-{e.name}" for s, e in CASES])
def test_every_edge_of_the_table(state, event) -> None:
    """Each method lands where the table says, or raises before any side effect; a page is
    freed once, when the session lets the request go."""
    s, sessions, port, sender, clock = drive(state)
    req = s.req
    before = (len(port.sent), len(sender.sends), len(port.failures))
    expected = SEND_TRANSITIONS.get((state, event))
    if expected is None:
        with pytest.raises(IllegalTransition):
            fire(event, s, sessions, port, sender, clock)
        assert s.state is state and (len(port.sent), len(sender.sends),
                                     len(port.failures)) == before
        return
    fire(event, s, sessions, port, sender, clock)
    assert s.state is expected
    assert (s.rid in sessions) == (not expected.is_terminal)
    if req is not None:
        released = port.released[req.uid]
        assert released == (0 if s.req is req else 1)
    if expected.is_terminal:
        assert port.alloc.num_used == (3 if event is E.TASK else 0)  # a late task is dropped
    if expected is state and event is not E.PAGES_COMPUTED:
        assert len(sender.sends) == before[1]  # nothing more sent


def test_task_bootstrap_early_pages_first_token_drain() -> None:
    sessions, port, sender, clock = send_table()
    req = computed_req(port, kv_len=0, first_token=False)
    s = sessions.open_task(req)
    assert s.state is T.BOOTSTRAPPING and s.deadline == clock() + TIMEOUT_S
    s.on_bootstrap(bootstrap())
    assert s.state is T.TRANSFERRING and s.deadline is None  # it ends with the compute
    assert port.take(KVKeepalive) == [KVKeepalive("r1")]  # the bootstrap's acknowledgement
    assert not sender.sends
    req.kv_len = 32  # a chunk: two complete pages
    s.send_computed_pages()
    s.send_computed_pages()  # nothing new
    assert sender.sends == [("r1", req.page_ids[:2], [11, 12], False, False)]
    req.kv_len = 40
    req.output_ids.append(5)
    req.output_logprobs.append(-0.1)
    sender.busy.add("r1")
    page_ids = list(req.page_ids)
    s.on_prefilled()
    assert sender.sends[-1] == ("r1", page_ids[2:], [13], True, False)
    assert s.state is T.DRAINING and port.alloc.num_used == 3  # the backend reads them still
    s.poll()
    assert s.state is T.DRAINING
    sender.busy.clear()
    s.poll()
    assert s.state is T.DONE and port.alloc.num_used == 0 and "r1" not in sessions
    assert not port.failures and not port.sent


def test_a_bootstrap_before_the_task_is_acknowledged_and_waits_for_it() -> None:
    sessions, port, _, clock = send_table()
    s = sessions.open_bootstrap(bootstrap())
    assert s.state is T.WAITING_FOR_TASK and port.take(KVKeepalive) == [KVKeepalive("r1")]
    clock.advance(1.5)
    s.keep_alive(clock())  # still alive here, though no task yet
    assert port.take(KVKeepalive) == [KVKeepalive("r1")]
    s.on_task(computed_req(port))
    assert s.state is T.TRANSFERRING and s.deadline is None


def test_a_bootstrap_whose_task_never_comes_expires_silently() -> None:
    sessions, port, _, clock = send_table()
    s = sessions.open_bootstrap(bootstrap())
    s.on_queued()  # late KVQueued: the deadline is the task's, not the queue's
    clock.advance(TIMEOUT_S + 0.5)
    assert sessions.expire(clock()) == [s]
    s.time_out()
    assert s.state is T.FAILED and not port.failures and not port.take(KVFailed)


def test_prefilled_before_the_bootstrap_sends_everything_at_once() -> None:
    sessions, port, sender, clock = send_table()
    req = computed_req(port)
    s = sessions.open_task(req)
    clock.advance(1.0)
    deadline = s.deadline
    s.on_prefilled()
    assert s.state is T.PREFILLED and s.deadline == deadline  # the same bootstrap is awaited
    page_ids = list(req.page_ids)
    s.on_bootstrap(bootstrap())
    assert sender.sends == [("r1", page_ids, [11, 12, 13], True, False)]
    assert s.state is T.DONE and port.alloc.num_used == 0


def test_a_request_ended_by_its_first_token_sends_no_more_pages() -> None:
    sessions, port, sender, _ = send_table()
    req = computed_req(port)
    req.finish_reason = "stop"
    s = sessions.open_task(req)
    s.on_prefilled()
    s.on_bootstrap(bootstrap())
    assert sender.sends == [("r1", [], [], True, True)]
    assert s.state is T.DONE and port.alloc.num_used == 0


@pytest.mark.parametrize("prefilled", [False, True])
def test_queued_restarts_the_bootstrap_deadline_and_silence_fails_it(prefilled) -> None:
    sessions, port, _, clock = send_table()
    s = sessions.open_task(computed_req(port))
    if prefilled:
        s.on_prefilled()
    for _ in range(4):  # the decode worker says "queued" every 2 s: 8 s, past the timeout
        clock.advance(2.0)
        assert not sessions.expire(clock())
        s.on_queued()
    clock.advance(TIMEOUT_S + 0.5)
    assert sessions.expire(clock()) == [s]
    s.time_out()
    assert s.state is T.FAILED and port.alloc.num_used == 0
    error = f"KV transfer timed out: no decode worker bootstrap within {TIMEOUT_S:g} s"
    assert port.failures == [("r1", error, 500)]


def test_queued_after_the_bootstrap_changes_nothing() -> None:
    sessions, port, _, _ = send_table()
    s = sessions.open_task(computed_req(port, kv_len=0))
    s.on_bootstrap(bootstrap())
    s.on_queued()
    assert s.state is T.TRANSFERRING and s.deadline is None


def test_keepalives_every_third_of_the_timeout_without_other_news() -> None:
    sessions, port, _, clock = send_table()
    req = computed_req(port, kv_len=0, first_token=False)
    s = sessions.open_task(req)
    s.on_bootstrap(bootstrap())
    port.take(KVKeepalive)
    clock.advance(1.0)
    s.keep_alive(clock())
    assert not port.take(KVKeepalive)  # exactly a third: not yet
    clock.advance(0.5)
    s.keep_alive(clock())
    assert port.take(KVKeepalive) == [KVKeepalive("r1")]
    clock.advance(1.0)
    req.kv_len = 16
    s.send_computed_pages()  # a page is news too
    clock.advance(1.0)
    s.keep_alive(clock())
    assert not port.take(KVKeepalive)
    port.unreachable = True
    clock.advance(1.5)
    s.keep_alive(clock())  # not delivered: logged, the decode side's deadline rules
    assert s.state is T.TRANSFERRING


@pytest.mark.parametrize("busy", [False, True])
def test_kv_failed_with_ack_answers_once_no_write_is_in_flight(busy) -> None:
    sessions, port, sender, _ = send_table()
    s = sessions.open_task(computed_req(port))
    s.on_bootstrap(bootstrap())
    if busy:
        sender.busy.add("r1")
    s.on_kv_failed(DECODE)
    assert sender.cancelled == ["r1"] and port.alloc.num_used == 0  # early pages freed at once
    assert not port.failures  # the decode worker has told the server
    if busy:
        assert s.state is T.RELEASING and not port.take(KVReleased)
        s.poll()
        assert not port.take(KVReleased)
        sender.busy.clear()
        s.poll()
    assert s.state is T.FAILED and port.take(KVReleased) == [KVReleased("r1")]


def test_kv_failed_while_draining_keeps_the_pages_until_read_then_acks() -> None:
    s, _, port, sender, _ = drive(T.DRAINING)
    s.on_kv_failed()  # without ack: nothing changes, the pages are still read
    assert s.state is T.DRAINING
    s.on_kv_failed(DECODE)
    assert s.state is T.RELEASING and port.alloc.num_used == 3
    sender.busy.clear()
    s.poll()
    assert s.state is T.FAILED and port.alloc.num_used == 0
    assert port.take(KVReleased) == [KVReleased("r1")]


def test_an_unknown_request_is_acknowledged_at_once_or_when_its_writes_end() -> None:
    sessions, port, sender, clock = send_table()
    sessions.open_release("gone", DECODE)
    assert port.take(KVReleased) == [KVReleased("gone")] and "gone" not in sessions
    sender.busy.add("writing")
    s = sessions.open_release("writing", DECODE)
    s.on_task(computed_req(port, "writing"))  # a late task: failed wins, it is dropped
    s.on_bootstrap(bootstrap("writing"))
    assert s.state is T.RELEASING and s.req is None and not port.take(KVReleased)
    clock.advance(TIMEOUT_S + 0.5)
    assert sessions.expire(clock()) == [s]
    s.time_out()  # a write that never ends: the decode side's own deadline rules
    assert s.state is T.FAILED and not port.take(KVReleased)


def test_draining_past_the_deadline_drops_the_peers_queue() -> None:
    s, sessions, port, sender, clock = drive(T.DRAINING)
    clock.advance(TIMEOUT_S + 0.5)
    assert sessions.expire(clock()) == [s]
    s.time_out()
    assert sender.cancelled_peers == [DECODE] and s.state is T.DONE
    assert port.alloc.num_used == 0


@pytest.mark.parametrize("error", [PeerUnreachable("queue full"), ValueError("bad endpoint")])
def test_a_failed_send_fails_both_sides(error) -> None:
    sessions, port, sender, _ = send_table()
    s = sessions.open_task(computed_req(port, kv_len=32))
    sender.error = error
    s.on_bootstrap(bootstrap())  # the early pages fail to go
    assert s.state is T.FAILED and port.alloc.num_used == 0
    assert port.failures == [("r1", f"KV transfer failed: {error}", 500)]
    assert port.take(KVFailed) == [KVFailed("r1", f"prefill worker: KV transfer failed: {error}")]


def test_too_few_reserved_pages_fail_the_request() -> None:
    sessions, port, sender, _ = send_table()
    s = sessions.open_task(computed_req(port))
    s.on_prefilled()
    s.on_bootstrap(bootstrap(page_ids=[11, 12]))
    assert s.state is T.FAILED and not sender.sends
    assert "decode reserved 2 pages, prompt needs 3" in port.failures[0][1]


def test_a_failure_before_the_bootstrap_tells_only_the_server() -> None:
    sessions, port, _, _ = send_table()
    s = sessions.open_task(computed_req(port))
    s.fail("grammar failed", 400, notify="grammar failed")
    assert port.failures == [("r1", "grammar failed", 400)] and not port.take(KVFailed)
    assert port.alloc.num_used == 0


def test_illegal_events_raise() -> None:
    sessions, port, _, _ = send_table()
    s = sessions.open_task(computed_req(port))
    with pytest.raises(IllegalTransition, match="TASK in state BOOTSTRAPPING"):
        s.on_task(computed_req(port, "r1"))
    s.on_bootstrap(bootstrap())
    with pytest.raises(IllegalTransition, match="BOOTSTRAP in state TRANSFERRING"):
        s.on_bootstrap(bootstrap())
    with pytest.raises(IllegalTransition):
        s.time_out()  # no deadline in TRANSFERRING
    with pytest.raises(IllegalTransition):
        s.poll()
