"""8-bit KV pages (``--kv-cache-dtype``) across the zmq and shm transfers: values and scales
arrive bit for bit, no other page is touched, and the handshake's layout check names the KV
dtype."""

from __future__ import annotations

import time

import pytest
import torch

from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.ipc.messages import KVBootstrap, KVPages
from splitserve.ipc.sockets import Inbox, Outbox, free_tcp_addr
from splitserve.kv_transfer.base import layout_from_msg, layout_to_msg
from splitserve.kv_transfer.shm_backend import ShmKVReceiver, ShmKVSender, create_shm_pool
from splitserve.kv_transfer.zmq_backend import ZmqKVReceiver, ZmqKVSender

KINDS = ["int8", "fp8_e4m3"]


def _recv_one(inbox: Inbox, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if inbox.poll(50):
            item = inbox.recv()
            if item is not None:
                return item
    raise TimeoutError("nothing received")


def _written_pool(layout: KVLayout, num_pages: int, pages: list[int]) -> KVPool:
    """A pool whose ``pages`` hold quantized random K/V in every layer, of varied scales."""
    torch.manual_seed(0)
    pool = KVPool(layout, num_pages)
    ps = layout.page_size
    ids = torch.tensor(pages).repeat_interleave(ps)
    offs = torch.arange(ps).repeat(len(pages))
    for layer in range(layout.num_layers):
        mag = torch.logspace(-2, 1, ids.numel())[:, None, None]
        k = torch.randn(ids.numel(), layout.num_kv_heads, layout.head_dim) * mag
        pool.write(layer, ids, offs, k, torch.randn_like(k))
    return pool


def _assert_same_pages(src: KVPool, src_pages: list[int], dst: KVPool, dst_pages: list[int]):
    assert torch.equal(dst.buffer[dst_pages], src.buffer[src_pages])  # raw bytes
    assert dst.scales is not None and src.scales is not None
    assert torch.equal(dst.scales[dst_pages], src.scales[src_pages])
    assert torch.count_nonzero(dst.scales[dst_pages]) == dst.scales[dst_pages].numel()
    assert torch.equal(dst.kv[dst_pages].view(torch.uint8), src.kv[src_pages].view(torch.uint8))
    untouched = [p for p in range(dst.allocator.num_pages) if p not in dst_pages]
    assert torch.count_nonzero(dst.buffer[untouched]) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_zmq_moves_values_and_scales(ctx, kind: str) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16",
                      kv_cache_dtype=kind)
    src_pages, dst_pages = [3, 7, 1, 12, 13], [9, 2, 15, 4, 5]  # runs and scattered pages
    src, dst = _written_pool(layout, 16, src_pages), KVPool(layout, 16)
    inbox, outbox = Inbox(ctx, free_tcp_addr()), Outbox(ctx)
    sender, receiver = ZmqKVSender(src, outbox), ZmqKVReceiver(dst)
    boot = KVBootstrap(rid="r1", dst_addr=inbox.addr, page_ids=[], layout=layout_to_msg(layout))
    sender.send(boot, src_pages, dst_pages, last=True, first_token=7)
    header, frames = _recv_one(inbox)
    assert isinstance(header, KVPages) and header.last
    receiver.install(header, frames)
    _assert_same_pages(src, src_pages, dst, dst_pages)
    assert sender.bytes_sent == 5 * layout.page_bytes
    inbox.close()
    outbox.close()


@pytest.mark.parametrize("kind", KINDS)
def test_shm_moves_values_and_scales(ctx, kind: str) -> None:
    layout = KVLayout(3, 2, 8, 4, "float32", kind)
    src_pages, dst_pages = [2, 3, 4, 9], [5, 6, 7, 1]
    src = _written_pool(layout, 12, src_pages)
    dst = create_shm_pool(layout, 10)
    receiver = ShmKVReceiver(dst)
    inbox, outbox = Inbox(ctx, free_tcp_addr()), Outbox(ctx)
    sender = ShmKVSender(src, outbox)
    boot = KVBootstrap(rid="r1", dst_addr=inbox.addr, page_ids=dst_pages,
                       layout=layout_to_msg(layout), kv_transfer="shm",
                       endpoint=receiver.endpoint())
    try:
        sender.send(boot, src_pages, dst_pages, last=True, first_token=7)
        header, frames = _recv_one(inbox)
        receiver.install(header, frames)
        _assert_same_pages(src, src_pages, dst, dst_pages)
        for layer in range(3):
            got = dst.gather(layer, 1, torch.tensor(dst_pages), torch.float32)
            assert torch.equal(got, src.gather(layer, 1, torch.tensor(src_pages), torch.float32))
    finally:
        sender.close()
        receiver.close()
        inbox.close()
        outbox.close()


def test_layout_message_carries_kv_dtype() -> None:
    layout = KVLayout(30, 3, 64, 16, "bfloat16", "fp8_e4m3")
    assert layout_from_msg(layout_to_msg(layout)) == layout
    refused = layout.mismatch(layout_from_msg(layout_to_msg(KVLayout(30, 3, 64, 16, "bfloat16"))))
    assert refused == "KV layout mismatch (kv_cache_dtype: fp8_e4m3 here vs auto on the peer)"
