"""ZeroMQ KV transfer: pages arrive bit for bit, bad frames are refused, the wire takes no pickle."""

from __future__ import annotations

import pickle
import time

import pytest
import torch
import zmq

from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.ipc import Inbox, Outbox, free_tcp_addr
from splitserve.kv_transfer.base import layout_to_msg
from splitserve.kv_transfer.zmq_backend import ZmqKVReceiver, ZmqKVSender
from splitserve.messages import AbortTask, KVBootstrap, KVPages


def boot_for(addr: str, layout: KVLayout, rid: str = "r1") -> KVBootstrap:
    return KVBootstrap(rid=rid, dst_addr=addr, page_ids=[], layout=layout_to_msg(layout))


def recv_one(inbox: Inbox, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if inbox.poll(50):
            item = inbox.recv()
            if item is not None:
                return item
    raise TimeoutError("nothing received")


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pages_roundtrip(ctx, dtype: str) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=dtype)
    src, dst = KVPool(layout, 16), KVPool(layout, 16)
    src.buffer.copy_(torch.randn(src.buffer.shape).to(src.buffer.dtype))
    inbox, outbox = Inbox(ctx, free_tcp_addr()), Outbox(ctx)
    sender, receiver = ZmqKVSender(src, outbox), ZmqKVReceiver(dst)
    src_pages, dst_pages = [3, 7, 1, 12], [9, 2, 15, 4]  # non-contiguous on both sides
    sender.send(boot_for(inbox.addr, layout), src_pages, dst_pages, last=True, first_token=42,
                first_logprob=-0.5)
    header, frames = recv_one(inbox)
    assert isinstance(header, KVPages) and header.first_token == 42 and header.last
    receiver.install(header, frames)
    assert torch.equal(dst.buffer[dst_pages], src.buffer[src_pages])
    untouched = [p for p in range(16) if p not in dst_pages]
    assert torch.count_nonzero(dst.buffer[untouched]) == 0
    assert sender.bytes_sent == 4 * layout.page_bytes
    inbox.close()
    outbox.close()


def test_receiver_refuses_wrong_size(ctx) -> None:
    layout = KVLayout(2, 1, 4, 2, "float32")
    receiver = ZmqKVReceiver(KVPool(layout, 8))
    header = KVPages(rid="r", page_ids=[1, 2], num_frames=1, last=True)
    with pytest.raises(ValueError, match="expected"):
        receiver.install(header, [b"\0" * (layout.page_bytes * 2 - 4)])
    with pytest.raises(ValueError, match="frames"):
        receiver.install(header, [])


def test_layout_mismatch_names_both_values() -> None:
    a = KVLayout(30, 3, 64, 16, "float32")
    b = KVLayout(30, 3, 64, 32, "bfloat16")
    msg = a.mismatch(b)
    assert "page_size: 16 here vs 32" in msg and "dtype: float32 here vs bfloat16" in msg
    assert a.mismatch(a) is None


def test_inbox_rejects_pickle_and_garbage(ctx) -> None:
    inbox = Inbox(ctx, free_tcp_addr())
    raw = ctx.socket(zmq.PUSH)
    raw.connect(inbox.addr)
    raw.send(pickle.dumps({"type": "abort", "rid": "x"}))
    raw.send_multipart([b"\xff\x00garbage", b"more"])
    Outbox(ctx).send(inbox.addr, AbortTask("ok"))
    got = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not got:
        if inbox.poll(50):
            item = inbox.recv()
            if item is not None:
                got.append(item[0])
    assert got == [AbortTask("ok")]  # the two bad messages were dropped, the good one arrived
    raw.close(0)
    inbox.close()


def test_contiguous_runs_go_zero_copy_and_are_tracked(ctx) -> None:
    """Runs of pages are frames over the pool's own memory; the sender reports them busy until
    ZeroMQ is done, and the receiver installs mixed runs and gathered pages in order."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")
    src, dst = KVPool(layout, 64), KVPool(layout, 64)
    src.buffer.copy_(torch.randn(src.buffer.shape))
    sender, receiver = ZmqKVSender(src, Outbox(ctx)), ZmqKVReceiver(dst)
    src_pages = [10, 11, 12, 13, 30, 5, 6, 7, 40]  # run, single, run, single
    dst_pages = [1, 2, 3, 4, 5, 20, 21, 22, 9]
    frames = sender.frames_for(src_pages)
    pool_base = src.buffer.data_ptr()
    pool_end = pool_base + src.buffer.numel() * 4
    addrs = [torch.frombuffer(f, dtype=torch.uint8).data_ptr() for f in frames]
    in_pool = [pool_base <= a < pool_end for a in addrs]
    assert in_pool == [True, False, True, False]  # runs are pool views; singles are gathered
    addr = free_tcp_addr()
    boot = boot_for(addr, layout)
    sender.send(boot, src_pages, dst_pages, last=True, first_token=1)
    assert not sender.is_done("r1")  # nobody is reading yet: the pool pages are still in use
    inbox = Inbox(ctx, addr)
    header, got = recv_one(inbox)
    receiver.install(header, got)
    assert torch.equal(dst.buffer[dst_pages], src.buffer[src_pages])
    deadline = time.monotonic() + 5
    while not sender.is_done("r1") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.is_done("r1")
    assert receiver.metrics.pages_received == len(src_pages)
    assert receiver.metrics.latency_s_sum > 0
    inbox.close()


def test_cancel_peer_releases_pages(ctx) -> None:
    """A peer that never reads: cancel_peer drops the queued frames so the pages can be freed."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")
    sender = ZmqKVSender(KVPool(layout, 16), Outbox(ctx))
    dead = free_tcp_addr()
    sender.send(boot_for(dead, layout, "r2"), [1, 2, 3], [4, 5, 6], last=True)
    time.sleep(0.1)
    assert not sender.is_done("r2")
    sender.cancel_peer(dead)
    assert sender.is_done("r2")
