"""ZeroMQ KV transfer: pages arrive bit for bit, bad frames are refused, the wire takes no pickle."""

from __future__ import annotations

import pickle
import time

import pytest
import torch
import zmq

from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.ipc.messages import AbortTask, KVBootstrap, KVPages, encode
from splitserve.ipc.sockets import Inbox, Outbox, free_tcp_addr
from splitserve.kv_transfer import zmq_backend
from splitserve.kv_transfer.base import layout_to_msg
from splitserve.kv_transfer.zmq_backend import ZmqKVReceiver, ZmqKVSender


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


def _patterned_pool(layout: KVLayout, num_pages: int) -> KVPool:
    pool = KVPool(layout, num_pages)
    pool.buffer.copy_(torch.arange(pool.buffer.numel()).view(pool.buffer.shape).to(pool.buffer.dtype))
    return pool


@pytest.mark.parametrize("case", ["short", "long", "missing", "extra", "outside", "no sizes"])
def test_bad_frames_never_touch_other_pages(case: str) -> None:
    """A frame of the wrong size, a missing or extra frame, or a header naming pages outside the
    pool fails the message; no page but the message's own is ever written (header errors: none)."""
    layout = KVLayout(2, 1, 4, 2, "float32")
    pool = _patterned_pool(layout, 8)
    before = pool.buffer.clone()
    receiver = ZmqKVReceiver(pool)
    pb = layout.page_bytes
    page_ids, frame_pages, frames = [3, 4], [2], [b"\1" * (2 * pb)]
    if case == "short":
        frames = [b"\1" * (2 * pb - 4)]
    elif case == "long":
        frames = [b"\1" * (3 * pb)]
    elif case == "missing":
        frame_pages, frames = [1, 1], [b"\1" * pb]
    elif case == "extra":
        frames = [b"\1" * (2 * pb), b"\1" * pb]
    elif case == "outside":
        page_ids = [7, 8]
    elif case == "no sizes":
        frame_pages = []
    header = KVPages(rid="r", page_ids=page_ids, num_frames=len(frame_pages), last=True,
                     frame_pages=frame_pages)
    with pytest.raises(ValueError, match="KV message for r"):
        receiver.install(header, frames)
    others = [p for p in range(8) if p not in (3, 4)]
    assert torch.equal(pool.buffer[others], before[others])
    if case in ("outside", "no sizes"):  # refused from the header alone: nothing written
        assert torch.equal(pool.buffer, before)


def test_bad_frames_over_the_socket_leave_the_next_message_intact(ctx) -> None:
    """A short frame straight from a socket fails its message; the frames it leaves unread are
    dropped, and the next message installs normally."""
    layout = KVLayout(2, 1, 4, 2, "float32")
    pool = _patterned_pool(layout, 8)
    before = pool.buffer.clone()
    receiver = ZmqKVReceiver(pool)
    inbox = Inbox(ctx, free_tcp_addr())
    raw = ctx.socket(zmq.PUSH)
    raw.connect(inbox.addr)
    pb = layout.page_bytes
    bad = KVPages(rid="bad", page_ids=[2, 5], num_frames=2, last=False, frame_pages=[1, 1])
    raw.send_multipart([encode(bad), b"\7" * (pb - 4), b"\7" * pb, b"\7" * 9])
    good = KVPages(rid="good", page_ids=[6], num_frames=1, last=True, frame_pages=[1])
    raw.send_multipart([encode(good), b"\0" * pb])
    header, frames = recv_one(inbox)
    with pytest.raises(ValueError, match="a frame of"):
        receiver.install(header, frames)
    header, frames = recv_one(inbox)
    assert header.rid == "good"
    receiver.install(header, frames)
    assert torch.count_nonzero(pool.buffer[6]) == 0
    untouched = [0, 1, 3, 4, 7]
    assert torch.equal(pool.buffer[untouched], before[untouched])
    raw.close(0)
    inbox.close()


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
    """Runs of pages consecutive on both sides are frames over the pool's own memory; the
    sender reports them busy until ZeroMQ is done, and the receiver puts each frame where it
    belongs."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")
    assert layout.page_bytes >= zmq_backend.MIN_ZERO_COPY_BYTES  # one page is worth a frame
    src, dst = KVPool(layout, 64), KVPool(layout, 64)
    src.buffer.copy_(torch.randn(src.buffer.shape))
    sender, receiver = ZmqKVSender(src, Outbox(ctx)), ZmqKVReceiver(dst)
    src_pages = [10, 11, 12, 13, 30, 5, 6, 7, 40, 41]
    dst_pages = [1, 2, 3, 4, 5, 20, 21, 22, 9, 30]  # the last run breaks on the receiving side
    frames, frame_pages = sender.frames_for(src_pages, dst_pages)
    assert frame_pages == [4, 1, 3, 1, 1]
    pool_base = src.buffer.data_ptr()
    pool_end = pool_base + src.buffer.numel() * 4
    addrs = [torch.frombuffer(f, dtype=torch.uint8).data_ptr() for f in frames]
    assert all(pool_base <= a < pool_end for a in addrs)  # no copies
    addr = free_tcp_addr()
    boot = boot_for(addr, layout)
    sender.send(boot, src_pages, dst_pages, last=True, first_token=1)
    assert not sender.is_done("r1")  # nobody is reading yet: the pool pages are still in use
    inbox = Inbox(ctx, addr)
    header, got = recv_one(inbox)
    receiver.install(header, got)
    assert torch.equal(dst.buffer[dst_pages], src.buffer[src_pages])
    assert receiver._staging.numel() == 0  # every frame went straight into the pool
    deadline = time.monotonic() + 5
    while not sender.is_done("r1") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.is_done("r1")
    assert receiver.metrics.pages_received == len(src_pages)
    assert receiver.metrics.latency_s_sum > 0
    inbox.close()


def test_small_pages_are_gathered_into_one_frame() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype="float32")
    sender = ZmqKVSender(KVPool(layout, 16), Outbox(zmq.Context.instance()))
    frames, frame_pages = sender.frames_for([1, 2, 3, 9], [4, 5, 6, 7])
    assert frame_pages == [4] and frames[0].nbytes == 4 * layout.page_bytes


def test_large_sends_split_into_messages(ctx, monkeypatch) -> None:
    """A send of more than MAX_MESSAGE_BYTES goes as several messages; only the final one is
    ``last`` and carries the first token. Scattered destinations go through the staging buffer."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16")
    monkeypatch.setattr(zmq_backend, "MAX_MESSAGE_BYTES", 2 * layout.page_bytes)
    src, dst = KVPool(layout, 16), KVPool(layout, 16)
    src.buffer.copy_(torch.randn(src.buffer.shape).to(torch.bfloat16))
    inbox, outbox = Inbox(ctx, free_tcp_addr()), Outbox(ctx)
    sender, receiver = ZmqKVSender(src, outbox), ZmqKVReceiver(dst)
    src_pages, dst_pages = [1, 2, 3, 4, 5], [9, 3, 4, 12, 14]
    sender.send(boot_for(inbox.addr, layout), src_pages, dst_pages, last=True, first_token=7)
    headers = []
    for _ in range(3):
        header, frames = recv_one(inbox)
        receiver.install(header, frames)
        headers.append(header)
    assert [h.page_ids for h in headers] == [[9, 3], [4, 12], [14]]
    assert [h.last for h in headers] == [False, False, True]
    assert [h.first_token for h in headers] == [-1, -1, 7]
    assert torch.equal(dst.buffer[dst_pages], src.buffer[src_pages])
    assert sender.metrics.messages_sent == 3 == receiver.metrics.messages_received
    inbox.close()
    outbox.close()


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
