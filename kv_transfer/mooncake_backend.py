"""KV transfer over Mooncake Transfer Engine (optional extra: ``pip install splitserve[mooncake]``).

Both workers start a ``TransferEngine`` (TCP protocol, peer-to-peer handshake: no metadata
server) and register their KV pool's memory. The decode worker's bootstrap ``endpoint`` names its
engine session (``host:rpc_port``) and the pool's base address; the prefill worker writes each run
of pages one-sidedly at ``base + page_id * page_bytes``, then sends the ``KVPages`` header over
ZeroMQ. Where RDMA devices exist the same engine would use them (protocol ``rdma``).

Writes run on one background thread (the engine's blocking ``batch_transfer_sync_write`` releases
the GIL, so prefill compute continues meanwhile); :meth:`MooncakeKVSender.poll` sends each
header, in order, once its pages are written. A failed write sends ``KVFailed`` to the decode
worker instead, which fails the request and frees its pages once this worker acknowledges.
:meth:`MooncakeKVSender.cancel` marks a request's queued writes to be skipped; the write in
flight, if any, cannot be recalled, so :meth:`MooncakeKVSender.is_done` stays False until it
ends: only then may the prefill worker acknowledge (``KVReleased``) that it writes no more.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from splitserve.engine.kv_pool import KVPool
from splitserve.frames import Frames, as_frames
from splitserve.ipc import Outbox, PeerUnreachable
from splitserve.kv_transfer.base import BaseKVReceiver, BaseKVSender, joint_runs
from splitserve.messages import KVBootstrap, KVFailed, KVPages

logger = logging.getLogger(__name__)

PROTOCOL = "tcp"


def _start_engine(host: str, pool: KVPool):
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ValueError(
            "KV transfer backend 'mooncake' needs Mooncake Transfer Engine: "
            f"pip install 'splitserve[mooncake]' ({exc})"
        ) from exc
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", PROTOCOL, "") != 0:
        raise ValueError(f"Mooncake Transfer Engine failed to start on {host} ({PROTOCOL})")
    buf = pool.buffer
    if engine.register_memory(buf.data_ptr(), buf.numel() * buf.element_size()) != 0:
        raise ValueError("Mooncake Transfer Engine could not register the KV pool")
    return engine


@dataclass(slots=True)
class _Job:
    dst_addr: str
    header: KVPages
    num_pages: int
    t0: float
    error: str | None = None
    done: bool = False  # set by the writer thread: written, failed or skipped
    cancelled: bool = False  # skip the write if it has not started; send no header


class MooncakeKVSender(BaseKVSender):
    """One-sided writes into the decode pool, on a background thread."""

    name = "mooncake"

    def __init__(self, pool: KVPool, outbox: Outbox, host: str = "127.0.0.1") -> None:
        super().__init__(pool)
        self.outbox = outbox
        self.engine = _start_engine(host, pool)
        self._jobs: deque[_Job] = deque()  # in submission order; headers go out in this order
        self._todo: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="mooncake-kv", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            job, session, srcs, dsts, lens = item
            if job.cancelled:
                job.done = True
                continue
            try:
                ret = self.engine.batch_transfer_sync_write(session, srcs, dsts, lens) if srcs else 0
                if ret != 0:
                    job.error = f"Mooncake write to {session} failed (code {ret})"
            except Exception as exc:  # noqa: BLE001 - reported to the decode worker
                job.error = f"Mooncake write to {session} failed: {exc}"
            job.done = True

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
        try:
            session = boot.endpoint["session"]
            dst_base = int(boot.endpoint["base_ptr"])
            dst_pages = int(boot.endpoint["num_pages"])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"bootstrap for {boot.rid} has no usable mooncake endpoint") from exc
        if dst_page_ids and (max(dst_page_ids) >= dst_pages or min(dst_page_ids) <= 0):
            raise ValueError(f"destination pages out of range for {boot.rid}")
        page_bytes = self.pool.layout.page_bytes
        src_base = self.pool.buffer.data_ptr()
        srcs, dsts, lens = [], [], []
        for s, d, n in joint_runs(src_page_ids, dst_page_ids):
            srcs.append(src_base + s * page_bytes)
            dsts.append(dst_base + d * page_bytes)
            lens.append(n * page_bytes)
        t0 = time.time()
        header = KVPages(
            rid=boot.rid, page_ids=dst_page_ids, num_frames=0, last=last, sent_at=t0,
            first_token=first_token, first_logprob=first_logprob, finished=finished,
        )
        job = _Job(boot.dst_addr, header, len(src_page_ids), t0)
        self._jobs.append(job)
        self._todo.put((job, session, srcs, dsts, lens))

    def poll(self) -> None:
        while self._jobs and self._jobs[0].done:
            job = self._jobs.popleft()
            if job.cancelled:
                continue
            try:
                if job.error:
                    logger.warning("request %s: %s", job.header.rid, job.error)
                    self.outbox.send(job.dst_addr, KVFailed(job.header.rid, job.error))
                    continue
                self.outbox.send(job.dst_addr, job.header)
            except PeerUnreachable as exc:
                logger.warning("request %s: %s", job.header.rid, exc)
            num_bytes = job.num_pages * self.pool.layout.page_bytes
            self.metrics.record_send(num_bytes, job.num_pages, time.time() - job.t0)

    def is_done(self, rid: str) -> bool:
        self.poll()
        return all(job.done for job in self._jobs if job.header.rid == rid)

    def cancel(self, rid: str) -> None:
        for job in self._jobs:
            if job.header.rid == rid:
                job.cancelled = True

    def cancel_peer(self, dst_addr: str) -> None:
        # Queued writes are skipped; one in flight cannot be recalled. The source pages are
        # registered memory of this pool, so freeing them now is safe (stale bytes at worst
        # reach a request that is gone).
        for job in self._jobs:
            if job.dst_addr == dst_addr:
                job.cancelled = True
        self.poll()

    def close(self) -> None:
        self._todo.put(None)


class MooncakeKVReceiver(BaseKVReceiver):
    """Registers the pool; pages are written by the peer before the header arrives."""

    name = "mooncake"
    one_sided = True

    def __init__(self, pool: KVPool, host: str = "127.0.0.1") -> None:
        super().__init__(pool)
        self.host = host
        self.engine = _start_engine(host, pool)

    def endpoint(self) -> dict[str, str]:
        return {
            "session": f"{self.host}:{self.engine.get_rpc_port()}",
            "base_ptr": str(self.pool.buffer.data_ptr()),
            "num_pages": str(self.pool.allocator.num_pages),
        }

    def install(self, header: KVPages, frames: Frames | list) -> None:
        if header.num_frames or as_frames(frames).more:
            raise ValueError(f"KV message for {header.rid}: mooncake transfer carries no frames")
        latency = time.time() - header.sent_at if header.sent_at else None
        num_bytes = len(header.page_ids) * self.pool.layout.page_bytes
        self.metrics.record_install(num_bytes, len(header.page_ids), latency)
