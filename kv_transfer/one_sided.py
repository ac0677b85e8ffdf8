"""What the one-sided engine backends (mooncake, nixl) share on the prefill side.

Such a backend writes a request's pages straight into the decode worker's registered pool, at
``base_ptr + page_id * page_bytes`` (both from the bootstrap's ``endpoint``), then sends the
``KVPages`` header over ZeroMQ. The writes run on one background thread per sender, in
submission order (the engines' blocking calls release the GIL, so prefill compute continues
meanwhile); :meth:`BaseOneSidedSender.poll` sends each header, in order, once its pages are
written. A failed write sends ``KVFailed`` to the decode worker instead, which fails the request
and frees its pages once this worker acknowledges (the fence, ``kv_transfer/recv_session.py``).
:meth:`BaseOneSidedSender.cancel` marks a request's queued writes to be skipped; the write in
flight, if any, cannot be recalled, so :meth:`BaseOneSidedSender.is_done` stays False until it
ends: only then may the prefill worker acknowledge (``KVReleased``) that it writes no more.

A backend supplies :meth:`BaseOneSidedSender._peer` (which engine peer a bootstrap names) and
:meth:`BaseOneSidedSender._write` (one blocking batch of writes, on the writer thread).
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from splitserve.engine.kv_pool import KVPool
from splitserve.ipc.messages import KVBootstrap, KVFailed, KVPages
from splitserve.ipc.sockets import Outbox, PeerUnreachable
from splitserve.kv_transfer.base import BaseKVSender, joint_runs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    dst_addr: str
    header: KVPages
    num_pages: int
    t0: float
    error: str | None = None
    done: bool = False  # set by the writer thread: written, failed or skipped
    cancelled: bool = False  # skip the write if it has not started; send no header


class BaseOneSidedSender(BaseKVSender):
    """Prefill side of a one-sided engine backend: writes on a background thread, headers in
    order from :meth:`poll`. ``pool``: this worker's KV pool, registered with the engine by the
    subclass before :meth:`send` is called."""

    def __init__(self, pool: KVPool, outbox: Outbox) -> None:
        super().__init__(pool)
        self.outbox = outbox
        self._jobs: deque[_Job] = deque()  # in submission order; headers go out in this order
        self._todo: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-kv", daemon=True)
        self._thread.start()

    @abc.abstractmethod
    def _peer(self, boot: KVBootstrap) -> object:
        """The engine peer that ``boot.endpoint`` names (whatever :meth:`_write` needs to reach
        it). Called on the caller's thread.

        Raises:
            KeyError, ValueError: the endpoint lacks a field or has a malformed one.
        """

    @abc.abstractmethod
    def _write(self, peer: object, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """Write ``lens[i]`` bytes from local address ``srcs[i]`` to the peer's address
        ``dsts[i]`` for every i, and return when all are written. Runs on the writer thread.

        Raises:
            Exception: the write failed; its message, which should name the peer, goes to the
                decode worker in ``KVFailed``.
        """

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            job, peer, srcs, dsts, lens = item
            if job.cancelled:
                job.done = True
                continue
            try:
                if srcs:
                    self._write(peer, srcs, dsts, lens)
            except Exception as exc:  # noqa: BLE001 - reported to the decode worker
                job.error = f"{self.name} write failed: {exc}"
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
        """Queue the write of pages ``src_page_ids`` into the peer's ``dst_page_ids`` (each run
        of pages consecutive on both sides is one write request of ``n * page_bytes`` bytes)
        and the header after it. Returns at once.

        Raises:
            ValueError: page counts differ, the endpoint is unusable, or a destination page is
                outside the peer's pool (ids 1 .. num_pages - 1; page 0 is never reserved).
        """
        if len(src_page_ids) != len(dst_page_ids):
            raise ValueError(f"{len(src_page_ids)} source pages for {len(dst_page_ids)} destinations")
        try:
            peer = self._peer(boot)
            dst_base = int(boot.endpoint["base_ptr"])
            dst_pages = int(boot.endpoint["num_pages"])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"bootstrap for {boot.rid} has no usable {self.name} endpoint") from exc
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
        self._todo.put((job, peer, srcs, dsts, lens))

    def poll(self) -> None:
        """Send the header (or ``KVFailed``) of every finished write at the head of the queue."""
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
        """Stop the writer thread after the writes already queued (waits up to 5 s)."""
        self._todo.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(5)
