"""worker.urgent_peek over a real ZeroMQ inbox: between layers it keeps whatever arrived, in
order and with its frames, and answers True only for a new request more urgent than the step's
rows that can start at once (no constraint, no adapter); the worker dispatches what it kept
before anything newer."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from splitserve.ipc.messages import (
    AbortTask,
    Constraint,
    GenerateTask,
    LoraRef,
    SamplingParams,
    encode,
)
from splitserve.ipc.sockets import Inbox
from splitserve.worker.urgent_peek import UrgentPeek


def task(rid: str, priority: int, **sampling) -> GenerateTask:
    return GenerateTask(rid=rid, input_ids=[1, 2, 3], reply_addr="inproc://r",
                        sampling=SamplingParams(priority=priority, **sampling))


def peek_until(peek: UrgentPeek, floor: int, count: int) -> bool:
    """Call ``check`` until ``count`` messages are kept (inproc delivery is not instant);
    whether any call answered True."""
    urgent = False
    deadline = time.monotonic() + 10
    while len(peek._kept) < count:
        urgent |= peek.check(floor)
        assert time.monotonic() < deadline, "messages never arrived"
    return urgent


@pytest.fixture
def link(request) -> Iterator[tuple[Inbox, zmq.Socket]]:
    """A real inbox and a PUSH socket connected to it (inproc), closed after the test."""
    ctx = zmq.Context()
    inbox = Inbox(ctx, f"inproc://peek-{request.node.name}")
    push = ctx.socket(zmq.PUSH)
    push.connect(inbox.addr)
    yield inbox, push
    push.close(0)
    inbox.close()
    ctx.term()


def test_keeps_every_message_in_order_with_its_frames(link) -> None:
    inbox, push = link
    peek = UrgentPeek(inbox)
    push.send_multipart([encode(task("a", 0)), b"first", b"second"])
    push.send_multipart([encode(AbortTask(rid="a"))])
    push.send_multipart([encode(task("b", 0))])
    assert not peek_until(peek, 0, 3)  # equally urgent: no interrupt
    kept = peek.drain()
    assert [type(m).__name__ for m, _ in kept] == ["GenerateTask", "AbortTask",
                                                   "GenerateTask"]
    msg, frames = kept[0]
    assert msg.rid == "a" and bytes(frames.read()) == b"first"
    buf = bytearray(6)
    assert frames.read_into(memoryview(buf)) == 6 and bytes(buf) == b"second"
    assert not frames.more and not kept[1][1].more
    assert peek.drain() == [] and peek.num_interrupts == 0


def test_only_an_urgent_request_that_can_start_at_once_interrupts(link) -> None:
    inbox, push = link
    peek = UrgentPeek(inbox)
    cases = [
        (task("same", 0), False),
        (task("later", 3), False),
        (task("grammar", -1, constraint=Constraint(kind="regex", text="a+")), False),
        (GenerateTask(rid="adapter", input_ids=[1], reply_addr="inproc://r",
                      sampling=SamplingParams(priority=-1),
                      lora=LoraRef(name="x", path="/x")), False),
        (task("urgent", -1), True),
    ]
    for i, (msg, expected) in enumerate(cases):
        push.send_multipart([encode(msg)])
        assert peek_until(peek, 0, i + 1) is expected, msg.rid
    assert peek.num_interrupts == 1
    assert [m.rid for m, _ in peek.drain()] == [m.rid for m, _ in cases]


def test_keeps_at_most_its_bound(link) -> None:
    inbox, push = link
    peek = UrgentPeek(inbox, max_kept=2)
    for i in range(4):
        push.send_multipart([encode(task(f"r{i}", 0))])
    peek_until(peek, 0, 2)
    assert not peek.check(0) and len(peek.drain()) == 2  # the rest wait in the socket
    rest = []
    while len(rest) < 2:
        assert inbox.poll(5000)
        item = inbox.recv()
        if item is not None:
            rest.append(item[0].rid)
    assert rest == ["r2", "r3"]
