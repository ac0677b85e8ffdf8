"""ZeroMQ KV transfer (the default backend; tcp:// between hosts, ipc:// on one host).

One ``KVPages`` header frame, then the pages as raw frames in ``page_ids`` order:

- each run of at least ``MIN_ZERO_COPY_PAGES`` consecutive source pages is one frame sent straight
  from the KV pool's memory (``copy=False``, no intermediate copy: pages are contiguous in the
  page-major pool). ZeroMQ reads that memory later, from its I/O thread, so the frame is tracked
  (``track=True``) and the source pages may be freed only once :meth:`ZmqKVSender.is_done` says so;
- shorter runs (scattered pages) are gathered into one staging frame, which owns its bytes.

A pool on a GPU is staged to host memory first (one gather + device-to-host copy per message).
No pickling and no per-element Python objects anywhere.
"""

from __future__ import annotations

import time

import torch
import zmq

from splitserve.engine.kv_pool import KVPool
from splitserve.ipc import Outbox
from splitserve.kv_transfer.base import BaseKVReceiver, BaseKVSender, contiguous_runs
from splitserve.messages import KVBootstrap, KVPages

# Runs shorter than this are gathered; one page is ~0.7 MiB for the default model (float32).
MIN_ZERO_COPY_PAGES = 2


def _bytes_view(t: torch.Tensor) -> memoryview:
    # bfloat16 has no numpy dtype: expose the raw bytes instead.
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


class ZmqKVSender(BaseKVSender):
    """Sends pages of ``pool`` through the worker's :class:`Outbox`."""

    name = "zmq"

    def __init__(self, pool: KVPool, outbox: Outbox) -> None:
        super().__init__(pool)
        self.outbox = outbox
        self.zero_copy = pool.buffer.device.type == "cpu" and pool.buffer.is_contiguous()
        self._trackers: dict[str, list[zmq.MessageTracker]] = {}
        self._rids_by_peer: dict[str, set[str]] = {}

    @property
    def bytes_sent(self) -> int:
        return self.metrics.bytes_sent

    def frames_for(self, page_ids: list[int]) -> list[memoryview]:
        """The frames carrying ``page_ids`` in order: pool views for long runs, gathered copies
        for the rest."""
        if not self.zero_copy:
            return [_bytes_view(self.pool.read_pages(page_ids).cpu())] if page_ids else []
        frames: list[memoryview] = []
        scattered: list[int] = []
        for start, n in contiguous_runs(page_ids):
            if n < MIN_ZERO_COPY_PAGES:
                scattered.extend(page_ids[start : start + n])
                continue
            if scattered:
                frames.append(_bytes_view(self.pool.read_pages(scattered)))
                scattered = []
            first = page_ids[start]
            frames.append(_bytes_view(self.pool.buffer[first : first + n]))
        if scattered:
            frames.append(_bytes_view(self.pool.read_pages(scattered)))
        return frames

    def send(
        self,
        boot: KVBootstrap,
        src_page_ids: list[int],
        dst_page_ids: list[int],
        *,
        last: bool,
        first_token: int = -1,
        first_logprob: float = 0.0,
        finished: bool = False,
    ) -> None:
        if len(src_page_ids) != len(dst_page_ids):
            raise ValueError(f"{len(src_page_ids)} source pages for {len(dst_page_ids)} destinations")
        t0 = time.time()
        frames = self.frames_for(src_page_ids)
        header = KVPages(
            rid=boot.rid,
            page_ids=dst_page_ids,
            num_frames=len(frames),
            last=last,
            sent_at=t0,
            first_token=first_token,
            first_logprob=first_logprob,
            finished=finished,
        )
        trackers = self.outbox.send(boot.dst_addr, header, frames, track=self.zero_copy)
        pending = [t for t in trackers if not t.done]
        if pending:
            self._trackers.setdefault(boot.rid, []).extend(pending)
            self._rids_by_peer.setdefault(boot.dst_addr, set()).add(boot.rid)
        num_bytes = len(src_page_ids) * self.pool.layout.page_bytes
        self.metrics.record_send(num_bytes, len(src_page_ids), time.time() - t0)

    def is_done(self, rid: str) -> bool:
        trackers = self._trackers.get(rid)
        if trackers is None:
            return True
        trackers[:] = [t for t in trackers if not t.done]
        if trackers:
            return False
        del self._trackers[rid]
        for rids in self._rids_by_peer.values():
            rids.discard(rid)
        return True

    def cancel_peer(self, dst_addr: str) -> None:
        self.outbox.reset(dst_addr)
        for rid in self._rids_by_peer.pop(dst_addr, set()):
            self._trackers.pop(rid, None)


class ZmqKVReceiver(BaseKVReceiver):
    """Installs received pages into ``pool`` (one copy: frame memory -> pool)."""

    name = "zmq"

    @property
    def bytes_received(self) -> int:
        return self.metrics.bytes_received

    def install(self, header: KVPages, frames: list) -> None:
        if len(frames) != header.num_frames:
            raise ValueError(
                f"KV message for {header.rid}: {len(frames)} frames, header says {header.num_frames}"
            )
        page_bytes = self.pool.layout.page_bytes
        bufs = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
        total = sum(b.nbytes for b in bufs)
        expected = len(header.page_ids) * page_bytes
        if total != expected or any(b.nbytes % page_bytes for b in bufs):
            raise ValueError(
                f"KV message for {header.rid}: {total} bytes in {len(bufs)} frames for "
                f"{len(header.page_ids)} pages, expected {expected} in whole pages"
            )
        page_shape = self.pool.buffer.shape[1:]
        offset = 0
        for buf in bufs:
            n = buf.nbytes // page_bytes
            if n == 0:
                continue
            data = torch.frombuffer(buf, dtype=torch.uint8).view(self.pool.buffer.dtype)
            write_pages(self.pool, header.page_ids[offset : offset + n], data.view(n, *page_shape))
            offset += n
        latency = time.time() - header.sent_at if header.sent_at else None
        self.metrics.record_install(expected, len(header.page_ids), latency)


def write_pages(pool: KVPool, page_ids: list[int], data: torch.Tensor) -> None:
    """``pool.write_pages`` with slice copies for runs of consecutive destination pages."""
    for start, n in contiguous_runs(page_ids):
        first = page_ids[start]
        pool.buffer[first : first + n].copy_(data[start : start + n])
