"""One-sided backends (shm, mooncake): a request that fails on the decode side keeps its pages
until the prefill worker acknowledges that it stopped writing them (``KVFailed`` with
``ack_addr`` -> ``KVReleased``), or, when no answer comes, until the transfer timeout; every page
is accounted for at the end on both sides. The decode worker's clock is a fake one where a test
is about its deadlines: they pass when the test says, however busy the machine."""

from __future__ import annotations

import importlib.util
import threading
import time

import msgspec
import pytest

from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.ipc.messages import (
    AbortTask,
    GenerateTask,
    KVBootstrap,
    KVFailed,
    KVReleased,
    SamplingParams,
)
from splitserve.ipc.sockets import Inbox, Outbox, free_tcp_addr
from splitserve.kv_transfer import mooncake_backend
from splitserve.kv_transfer.base import layout_to_msg
from splitserve.kv_transfer.session import TransferState
from tests.kv_transfer.session_fakes import FakeClock
from tests.kv_transfer.workers import OPTIONAL_BACKENDS, make_worker, run_until

ONE_SIDED = ["shm", *OPTIONAL_BACKENDS]
LONG_PROMPT = list(range(100, 400))  # 10 chunks of 32 tokens; 19 pages
OLD_QUARANTINE_S = 3.0  # the fixed hold this handshake replaced: the tests wait longer than it
NUM_LOOPS = 30  # worker loop iterations that "nothing happens" is checked over


def start_request(server: Inbox, prefill, decode) -> None:
    """Give both workers request r1 and run them until an early chunk reached the decode pool."""
    sampling = SamplingParams(max_new_tokens=4, temperature=0)
    prefill.dispatch(GenerateTask(rid="r1", input_ids=LONG_PROMPT, reply_addr=server.addr,
                                  sampling=sampling), [])
    decode.dispatch(GenerateTask(rid="r1", input_ids=LONG_PROMPT, reply_addr=server.addr,
                                 sampling=sampling, prefill_addr=prefill.config.addr), [])
    run_until([prefill, decode], server, lambda _: decode.receiver.metrics.pages_received > 0)
    assert decode.sessions.get("r1").state is TransferState.WAITING_FOR_PAGES  # mid-transfer


def run_alone(worker, loops: int = NUM_LOOPS) -> None:
    for _ in range(loops):
        worker.run_once(idle_wait_ms=10)


def freeze_clock(worker) -> FakeClock:
    """Give ``worker`` a clock that moves only when the test advances it."""
    worker.clock = clock = FakeClock(worker.now())
    return clock


@pytest.mark.parametrize("backend", ONE_SIDED)
def test_pages_freed_only_after_the_ack(ctx, model_path, backend) -> None:
    server = Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, backend)
    decode = make_worker(model_path, "decode", server.addr, backend)
    start_request(server, prefill, decode)
    reserved = decode.pool.allocator.num_used
    assert reserved == 19
    clock = freeze_clock(decode)
    decode.dispatch(AbortTask("r1"), [])  # the decode side gives up (only it hears of it)
    clock.advance(OLD_QUARANTINE_S + 0.5)
    run_alone(decode)  # the prefill worker has not answered yet
    assert decode.pool.allocator.num_used == reserved
    assert decode.sessions.get("r1").state is TransferState.FENCED
    # The prefill worker reads the KVFailed, drops r1, acknowledges; then the pages come back.
    run_until([prefill, decode], server, lambda _: decode.pool.allocator.num_used == 0,
              timeout_s=5)
    assert "r1" not in decode.sessions and "r1" not in prefill.sessions
    sent = prefill.sender.metrics.messages_sent
    run_until([prefill, decode], server, lambda _: prefill.pool.allocator.num_used == 0,
              timeout_s=5)
    run_alone(prefill)
    assert prefill.sender.metrics.messages_sent == sent  # nothing written after the ack
    assert decode.pool.allocator.num_used == 0 == prefill.pool.allocator.num_used
    decode.scheduler.check_pages()
    decode.receiver.close()
    prefill.sender.close()


def test_pages_freed_at_the_timeout_when_the_prefill_worker_hangs(ctx, model_path) -> None:
    """No answer and the link stays up (a hung worker): fenced until the transfer timeout, not
    a loop earlier, and freed at it."""
    server = Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, "shm")
    decode = make_worker(model_path, "decode", server.addr, "shm", transfer_timeout_s=1.5)
    start_request(server, prefill, decode)
    clock = freeze_clock(decode)
    decode.dispatch(AbortTask("r1"), [])  # the prefill worker runs no more from here
    clock.advance(1.5)  # the deadline itself: not past it yet
    run_alone(decode)
    assert decode.pool.allocator.num_used == 19  # still fenced
    assert decode.sessions.get("r1").state is TransferState.FENCED
    clock.advance(0.5)
    run_until([decode], server, lambda _: decode.pool.allocator.num_used == 0, timeout_s=5)
    assert not decode.sessions.by_state(TransferState.FENCED)
    decode.scheduler.check_pages()
    decode.receiver.close()


def test_pages_freed_at_once_when_the_prefill_worker_is_gone(ctx, model_path) -> None:
    """The link to the prefill worker dropped (its process is gone): nobody can write any more."""
    server = Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, "shm")
    decode = make_worker(model_path, "decode", server.addr, "shm", transfer_timeout_s=30)
    start_request(server, prefill, decode)
    freeze_clock(decode)  # no deadline passes: only the link drop can free the pages
    prefill.inbox.close()  # what the kernel does to a dead process's sockets
    prefill.outbox.close()
    decode.dispatch(AbortTask("r1"), [])
    run_until([decode], server, lambda _: decode.pool.allocator.num_used == 0, timeout_s=5)
    assert not decode.sessions.by_state(TransferState.FENCED)
    decode.scheduler.check_pages()
    decode.receiver.close()


def test_prefill_worker_acks_a_request_it_does_not_know(ctx, model_path) -> None:
    """Nothing in flight for an unknown (finished, aborted, never seen) request: answer at once."""
    server, decode_inbox = Inbox(ctx, free_tcp_addr()), Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, "shm")
    prefill.dispatch(KVFailed("gone", "decode gave up", ack_addr=decode_inbox.addr), [])
    got = run_until([prefill], decode_inbox, lambda g: KVReleased("gone") in g, timeout_s=5)
    assert got == [KVReleased("gone")]


class SlowEngine:
    """A Mooncake engine stand-in whose first write blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.writes: list[list[int]] = []

    def batch_transfer_sync_write(self, session, srcs, dsts, lens) -> int:
        self.writes.append(list(dsts))
        self.started.set()
        self.release.wait(10)
        return 0


def test_mooncake_cancel_skips_queued_writes_and_waits_for_the_running_one(ctx, monkeypatch) -> None:
    engine = SlowEngine()
    monkeypatch.setattr(mooncake_backend, "_start_engine", lambda host, pool: engine)
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="float32")
    decode_inbox = Inbox(ctx, free_tcp_addr())
    sender = mooncake_backend.MooncakeKVSender(KVPool(layout, 16), Outbox(ctx))
    boot = KVBootstrap(rid="r1", dst_addr=decode_inbox.addr, page_ids=[1, 2, 3],
                       layout=layout_to_msg(layout), kv_transfer="mooncake",
                       endpoint={"session": "peer:1", "base_ptr": "4096", "num_pages": "16"})
    sender.send(boot, [1], [1], last=False)
    sender.send(boot, [2], [2], last=False)
    sender.send(boot, [3], [3], last=True, first_token=5)
    assert engine.started.wait(5)
    sender.cancel("r1")
    time.sleep(0.1)
    assert not sender.is_done("r1")  # the first write is still running: no ack yet
    engine.release.set()
    deadline = time.monotonic() + 5
    while not sender.is_done("r1") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.is_done("r1")
    assert len(engine.writes) == 1  # the two queued writes were skipped
    assert not decode_inbox.poll(100)  # and no header announced pages for a cancelled request
    sender.close()


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="NIXL not installed")
def test_nixl_failed_write_sends_kvfailed(ctx) -> None:
    """A write to memory the decode agent never registered fails inside NIXL: the sender
    reports ``KVFailed`` (naming the agent) instead of the header, and is done with the request."""
    from splitserve.kv_transfer.nixl_backend import NixlKVReceiver, NixlKVSender

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="float32")
    receiver = NixlKVReceiver(KVPool(layout, 16))
    decode_inbox = Inbox(ctx, free_tcp_addr())
    sender = NixlKVSender(KVPool(layout, 16), Outbox(ctx))
    endpoint = dict(receiver.endpoint(), base_ptr="4096")  # not the registered pool
    boot = KVBootstrap(rid="r1", dst_addr=decode_inbox.addr, page_ids=[1, 2],
                       layout=layout_to_msg(layout), kv_transfer="nixl", endpoint=endpoint)
    sender.send(boot, [1, 2], [1, 2], last=True, first_token=5)
    deadline = time.monotonic() + 10
    while not sender.is_done("r1") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.is_done("r1")
    assert decode_inbox.poll(2000)
    msg = decode_inbox.recv()[0]
    assert isinstance(msg, KVFailed) and "nixl write failed" in msg.message
    assert receiver.agent.name in msg.message
    with pytest.raises(ValueError, match="no usable nixl endpoint"):
        sender.send(msgspec.structs.replace(boot, endpoint={"nixl_agent": "x"}), [1], [1], last=True)
    sender.close()
    receiver.close()
