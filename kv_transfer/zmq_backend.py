"""ZeroMQ KV transfer (the default backend): one ``KVPages`` header frame, then the pages as one
raw frame taken straight from a gathered tensor (``copy=False``: ZeroMQ sends from that memory;
no pickling, no per-element Python objects).
"""

from __future__ import annotations

import torch

from splitserve.engine.kv_pool import KVPool
from splitserve.ipc import Outbox
from splitserve.kv_transfer.base import BaseKVReceiver, BaseKVSender
from splitserve.messages import KVPages


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    # bfloat16 has no numpy dtype: expose the raw bytes instead. A GPU pool's pages are copied
    # to host memory first (.cpu() is a no-op for a CPU tensor).
    return memoryview(t.contiguous().cpu().view(torch.uint8).reshape(-1).numpy())


class ZmqKVSender(BaseKVSender):
    """Sends pages of ``pool`` through the worker's :class:`Outbox`."""

    def __init__(self, pool: KVPool, outbox: Outbox) -> None:
        self.pool = pool
        self.outbox = outbox
        self.bytes_sent = 0
        self.pages_sent = 0

    def send(
        self,
        dst_addr: str,
        rid: str,
        src_page_ids: list[int],
        dst_page_ids: list[int],
        first_token: int,
        first_logprob: float,
        finished: bool,
    ) -> None:
        if len(src_page_ids) != len(dst_page_ids):
            raise ValueError(f"{len(src_page_ids)} source pages for {len(dst_page_ids)} destinations")
        frames = []
        if src_page_ids:
            # The gather is a fresh tensor, so the pool pages can be reused while ZeroMQ sends.
            frames.append(_as_bytes_view(self.pool.read_pages(src_page_ids)))
            self.bytes_sent += frames[0].nbytes
            self.pages_sent += len(src_page_ids)
        header = KVPages(
            rid=rid,
            page_ids=dst_page_ids,
            num_frames=len(frames),
            last=True,
            first_token=first_token,
            first_logprob=first_logprob,
            finished=finished,
        )
        self.outbox.send(dst_addr, header, frames)


class ZmqKVReceiver(BaseKVReceiver):
    """Installs received pages into ``pool``."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.bytes_received = 0

    def install(self, header: KVPages, frames: list) -> None:
        if len(frames) != header.num_frames:
            raise ValueError(f"KV message for {header.rid}: {len(frames)} frames, header says {header.num_frames}")
        if not header.page_ids:
            return
        expected = len(header.page_ids) * self.pool.layout.page_bytes
        buf = frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]
        if len(buf) != expected:
            raise ValueError(
                f"KV message for {header.rid}: {len(buf)} bytes for {len(header.page_ids)} pages, "
                f"expected {expected}"
            )
        page_shape = self.pool.buffer.shape[1:]
        data = torch.frombuffer(buf, dtype=torch.uint8).view(self.pool.buffer.dtype)
        self.pool.write_pages(header.page_ids, data.view(len(header.page_ids), *page_shape))
        self.bytes_received += expected
