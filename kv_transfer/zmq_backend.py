"""ZeroMQ KV transfer (the default backend; tcp:// between hosts, ipc:// on one host).

A send is split into messages of at most ``MAX_MESSAGE_BYTES`` of pages. Each message is one
``KVPages`` header frame, then the pages as raw frames in ``page_ids`` order, ``frame_pages[i]``
pages in frame ``i``:

- each run of pages consecutive on both sides (source and destination) of at least
  ``MIN_ZERO_COPY_BYTES`` is one frame sent straight from the KV pool's memory (``copy=False``,
  no intermediate copy: pages are contiguous in the page-major pool). ZeroMQ reads that memory
  later, from its I/O thread, so the frame is tracked (``track=True``) and the source pages may be
  freed only once :meth:`ZmqKVSender.is_done` says so;
- shorter runs are gathered into one staging frame per message, which owns its bytes.

The receiver checks the header (frame sizes add up, pages inside the pool) before it writes
anything, then receives each frame straight into its destination pages (``recv_into``: ZeroMQ's
buffer -> pool, the only copy on this side) when they are consecutive, or into a reusable
staging buffer and from there into the pages. A frame of the wrong size fails its message; at
worst it has written into the pages of its own request, never into other pages.

Why messages of a few MiB rather than one per send: ZeroMQ hands a multipart message over only
once all of it has arrived, in one freshly allocated buffer per frame. A 512 MiB message is
512 MiB of new memory to fault in, copied into the pool after the last byte arrived; 2 MiB
messages reuse warm buffers (with ``splitserve.kv_transfer.malloc.keep_freed_buffers``) and are copied
while the next one is on the wire (``bench/kv_transfer.py``; docs/performance.md, "KV transfer"). A GPU pool is staged to host memory per message.
No pickling and no per-element Python objects anywhere.
"""

from __future__ import annotations

import time

import torch
import zmq

from splitserve.engine.kv_pool import KVPool
from splitserve.ipc.frames import Frames, as_frames
from splitserve.ipc.messages import KVBootstrap, KVPages
from splitserve.ipc.sockets import Outbox
from splitserve.kv_transfer.base import (
    BaseKVReceiver,
    BaseKVSender,
    KVTransferBackend,
    contiguous_runs,
    joint_runs,
)
from splitserve.kv_transfer.malloc import keep_freed_buffers

# Bytes of pages per message (at least one page). One page is 0.7 MiB for the default model in
# float32; see the module docstring for why messages are kept this small.
MAX_MESSAGE_BYTES = 2 * 2**20
# Runs shorter than this are gathered into a staging frame: below it pyzmq copies the frame
# anyway (its copy threshold), and a tracked zero-copy frame costs more than the copy.
MIN_ZERO_COPY_BYTES = 64 * 2**10
# The receiver keeps a staging buffer up to this size between messages (bytes).
MAX_KEPT_STAGING_BYTES = 4 * MAX_MESSAGE_BYTES


def _bytes_view(t: torch.Tensor) -> memoryview:
    # bfloat16 has no numpy dtype: expose the raw bytes instead.
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def pages_per_message(page_bytes: int) -> int:
    """Pages in one message: as many as fit ``MAX_MESSAGE_BYTES``, at least one."""
    return max(1, MAX_MESSAGE_BYTES // page_bytes)


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

    def frames_for(self, src: list[int], dst: list[int]) -> tuple[list[memoryview], list[int]]:
        """The frames carrying source pages ``src`` (bound for ``dst``) in order, and the pages
        in each: pool views for long runs, one gathered copy for the rest."""
        if not src:
            return [], []
        if not self.zero_copy:
            return [_bytes_view(self.pool.read_pages(src).cpu())], [len(src)]
        min_pages = -(-MIN_ZERO_COPY_BYTES // self.pool.layout.page_bytes)
        runs = joint_runs(src, dst)
        if all(n < min_pages for _, _, n in runs):
            return [_bytes_view(self.pool.read_pages(src))], [len(src)]
        frames: list[memoryview] = []
        frame_pages: list[int] = []
        scattered: list[int] = []

        def flush() -> None:
            if scattered:
                frames.append(_bytes_view(self.pool.read_pages(scattered)))
                frame_pages.append(len(scattered))
                scattered.clear()

        for s, _, n in runs:
            if n < min_pages:
                scattered.extend(range(s, s + n))
                continue
            flush()  # pages stay in order: gathered ones before this run go first
            frames.append(_bytes_view(self.pool.buffer[s : s + n]))
            frame_pages.append(n)
        flush()
        return frames, frame_pages

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
        step = pages_per_message(self.pool.layout.page_bytes)
        final = max(0, len(src_page_ids) - 1) // step * step  # start of the final message
        for start in range(0, final, step):
            self._send_message(boot, src_page_ids[start : start + step],
                               dst_page_ids[start : start + step], last=False)
        self._send_message(boot, src_page_ids[final:], dst_page_ids[final:], last=last,
                           first_token=first_token, first_logprob=first_logprob, finished=finished)

    def _send_message(
        self, boot: KVBootstrap, src: list[int], dst: list[int], *, last: bool,
        first_token: int = -1, first_logprob: float = 0.0, finished: bool = False,
    ) -> None:
        """One ``KVPages`` message carrying pages ``src`` into ``dst``."""
        t0 = time.time()
        frames, frame_pages = self.frames_for(src, dst)
        header = KVPages(
            rid=boot.rid, page_ids=dst, num_frames=len(frames), frame_pages=frame_pages,
            last=last, sent_at=t0, first_token=first_token, first_logprob=first_logprob,
            finished=finished,
        )
        trackers = self.outbox.send(boot.dst_addr, header, frames, track=self.zero_copy)
        pending = [t for t in trackers if not t.done]
        if pending:
            self._trackers.setdefault(boot.rid, []).extend(pending)
            self._rids_by_peer.setdefault(boot.dst_addr, set()).add(boot.rid)
        self.metrics.record_send(len(src) * self.pool.layout.page_bytes, len(src), time.time() - t0)

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
    """Receives each frame straight into ``pool`` (one copy: ZeroMQ's buffer -> pool)."""

    name = "zmq"

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        self.direct = pool.buffer.device.type == "cpu" and pool.buffer.is_contiguous()
        self._staging = torch.empty(0, dtype=torch.uint8)
        keep_freed_buffers()  # ZeroMQ's frame buffers: reused, not faulted in per message

    @property
    def bytes_received(self) -> int:
        return self.metrics.bytes_received

    def install(self, header: KVPages, frames: Frames | list) -> None:
        """Receive the frames of ``header`` into its pages.

        Raises:
            ValueError: the header's frame sizes do not add up or name pages outside the pool
                (nothing written), or a frame is missing, extra or of the wrong size (this
                message's earlier frames and, for a short or long frame read straight into the
                pool, the first bytes of its own destination pages are written).
        """
        src = as_frames(frames)
        try:
            self._check(header)
            offset = 0
            for n in header.frame_pages:
                if not src.more:
                    raise ValueError(f"KV message for {header.rid}: fewer frames than "
                                     f"the {header.num_frames} its header says")
                self._receive_frame(header.rid, src, header.page_ids[offset : offset + n])
                offset += n
            if src.more:
                raise ValueError(f"KV message for {header.rid}: more frames than "
                                 f"the {header.num_frames} its header says")
        finally:
            src.discard()
        num_bytes = len(header.page_ids) * self.pool.layout.page_bytes
        latency = time.time() - header.sent_at if header.sent_at else None
        self.metrics.record_install(num_bytes, len(header.page_ids), latency)

    def _check(self, header: KVPages) -> None:
        """Refuse a header that does not describe whole pages of this pool (before any write)."""
        fp = header.frame_pages
        if len(fp) != header.num_frames or any(n <= 0 for n in fp) or sum(fp) != len(header.page_ids):
            raise ValueError(
                f"KV message for {header.rid}: {header.num_frames} frames of {fp} pages do not "
                f"carry its {len(header.page_ids)} pages, expected whole pages per frame"
            )
        num_pages = self.pool.allocator.num_pages
        if header.page_ids and not (0 < min(header.page_ids) and max(header.page_ids) < num_pages):
            raise ValueError(f"KV message for {header.rid}: pages outside the pool of {num_pages}")

    def _receive_frame(self, rid: str, src: Frames, page_ids: list[int]) -> None:
        """Receive one frame holding ``page_ids`` (in order) into the pool."""
        n = len(page_ids)
        expected = n * self.pool.layout.page_bytes
        first = page_ids[0]
        if self.direct and contiguous_runs(page_ids) == [(0, n)]:
            size = src.read_into(_bytes_view(self.pool.buffer[first : first + n]))
            staged = None
        else:
            staged = self._staging_bytes(expected)
            size = src.read_into(_bytes_view(staged))
        if size != expected:
            raise ValueError(f"KV message for {rid}: a frame of {size} bytes for {n} pages, "
                             f"expected {expected}")
        if staged is not None:
            data = staged.view(self.pool.buffer.dtype).view(n, *self.pool.buffer.shape[1:])
            write_pages(self.pool, page_ids, data)

    def _staging_bytes(self, num_bytes: int) -> torch.Tensor:
        """A uint8 host buffer of ``num_bytes``, reused between messages up to a bound."""
        if num_bytes > MAX_KEPT_STAGING_BYTES:
            return torch.empty(num_bytes, dtype=torch.uint8)
        if self._staging.numel() < num_bytes:
            self._staging = torch.empty(num_bytes, dtype=torch.uint8)
        return self._staging[:num_bytes]


def write_pages(pool: KVPool, page_ids: list[int], data: torch.Tensor) -> None:
    """Copy ``data`` (``[len(page_ids), *page shape]``, host or device) into pages ``page_ids``,
    one slice copy per run of consecutive destination pages."""
    for start, n in contiguous_runs(page_ids):
        first = page_ids[start]
        pool.buffer[first : first + n].copy_(data[start : start + n])


BACKEND = KVTransferBackend("zmq", ZmqKVSender, ZmqKVReceiver)
