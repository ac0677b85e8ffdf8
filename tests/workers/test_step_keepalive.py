"""The step keepalive thread (``worker.step_keepalive``) against a real ZeroMQ inbox: a step's
messages go out every interval while it runs, none after it ends, none past its limit; the
thread ends when idle and when closed, its sockets with it."""

from __future__ import annotations

import time

import pytest
import zmq

from splitserve.ipc.messages import KVKeepalive
from splitserve.ipc.sockets import Inbox, free_tcp_addr
from splitserve.worker.step_keepalive import StepKeepalive


def received(inbox: Inbox, count: int, timeout_s: float = 20.0) -> list:
    """Wait (on the socket) until ``count`` messages came; returns them."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        if inbox.poll(50):
            while (item := inbox.recv()) is not None:
                got.append(item[0])
    return got


def test_repeats_while_the_step_runs_and_stops_at_its_end(ctx) -> None:
    inbox = Inbox(ctx, free_tcp_addr())
    keep = StepKeepalive(ctx, interval_s=0.01, limit_s=60.0)
    keep.begin([(inbox.addr, KVKeepalive("r1")), (inbox.addr, KVKeepalive("r2"))])
    got = received(inbox, 4)
    keep.end()
    assert len(got) >= 4 and {m.rid for m in got} == {"r1", "r2"}
    sent = keep.num_sent
    # A step with a long interval that ends at once sends nothing; nor does one with no messages.
    keep.interval_s = 30.0
    keep.begin([(inbox.addr, KVKeepalive("r3"))])
    keep.end()
    keep.begin([])
    keep.close()
    assert keep.num_sent == sent
    assert all(m.rid != "r3" for m in received(inbox, len(got) + 1, timeout_s=0.2)[len(got):])


def test_a_step_past_its_limit_is_not_kept_alive(ctx) -> None:
    """A hung step: once ``limit_s`` has passed on the clock, its keepalives stop, so the decode
    worker's deadline ends the transfer."""
    now = [100.0]
    keep = StepKeepalive(ctx, interval_s=0.01, limit_s=1.0, clock=lambda: now[0])
    inbox = Inbox(ctx, free_tcp_addr())
    keep.begin([(inbox.addr, KVKeepalive("r1"))])
    now[0] += 5.0  # the step has run for 5 s: past its limit
    deadline = time.monotonic() + 20
    while keep.num_past_limit == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a counter the thread moves, not a guessed duration
    keep.end()
    keep.close()
    assert keep.num_past_limit > 0 and keep.num_sent == 0


def test_bad_intervals_are_refused(ctx) -> None:
    with pytest.raises(ValueError, match="positive"):
        StepKeepalive(ctx, interval_s=0.0, limit_s=1.0)


def test_close_closes_its_sockets(ctx) -> None:
    """Closed, the thread holds no socket: the context terminates at once; later steps are not
    kept alive."""
    c = zmq.Context()
    keep = StepKeepalive(c, interval_s=0.01, limit_s=60.0)
    inbox = Inbox(ctx, free_tcp_addr())
    keep.begin([(inbox.addr, KVKeepalive("r1"))])
    assert received(inbox, 1)
    keep.end()
    keep.close()
    c.term()  # would block on a socket left open
    keep.begin([(inbox.addr, KVKeepalive("r2"))])
    assert not keep.is_running


def test_idle_thread_ends_and_a_new_step_starts_another(ctx) -> None:
    """No step for ``idle_exit_s``: the thread ends (so a forgotten worker's context can end);
    the next step starts a new one, which keeps it alive as the first did."""
    c = zmq.Context()
    keep = StepKeepalive(c, interval_s=0.01, limit_s=60.0, idle_exit_s=0.05)
    inbox = Inbox(ctx, free_tcp_addr())
    keep.begin([(inbox.addr, KVKeepalive("r1"))])
    assert received(inbox, 1)
    keep.end()
    deadline = time.monotonic() + 20
    while keep.is_running and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the thread's state, not a guessed duration
    assert not keep.is_running
    c.term()  # the ended thread closed its sockets: nothing blocks
    c = keep.ctx = zmq.Context()
    keep.begin([(inbox.addr, KVKeepalive("r2"))])
    assert [m.rid for m in received(inbox, 1)] == ["r2"] and keep.num_threads == 2
    keep.close()
    c.term()
