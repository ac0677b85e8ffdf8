"""Same-host KV transfer through shared memory.

The decode worker's KV pool lives in a named segment ``/dev/shm/splitserve-kv-<pid>-<token>``
(``ShmSegment``); its name travels in every ``KVBootstrap`` (``endpoint["shm_name"]``). The
prefill worker maps that segment once and copies each chunk's pages straight from its own pool
into the reserved destination pages (one memcpy per run of pages), then sends only the small
``KVPages`` header over ZeroMQ. The copy is synchronous, so the source pages are free to reuse as
soon as :meth:`ShmKVSender.send` returns.

Clean-up: the owner unlinks its segment when it exits (``close``, or ``atexit``), the launcher
unlinks its children's segments after stopping them, and every new segment's creator first
removes segments whose owner process is gone (``sweep_stale_segments``), which covers a SIGKILL.
The name is not unlinked while the owner lives, because prefill workers may map it at any time.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import secrets
import time
from pathlib import Path

import torch

from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.ipc.frames import Frames, as_frames
from splitserve.ipc.messages import KVBootstrap, KVPages
from splitserve.ipc.sockets import Outbox
from splitserve.kv_transfer.base import BaseKVReceiver, BaseKVSender, KVTransferBackend, joint_runs

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "splitserve-kv-"


def _owner_alive(name: str) -> bool:
    try:
        pid = int(name[len(PREFIX) :].split("-")[0])
    except ValueError:
        return True  # not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(pids: set[int] | None = None) -> list[str]:
    """Unlink segments whose owner process is gone (or, with ``pids``, owned by one of them).
    Returns the names removed."""
    removed = []
    for path in SHM_DIR.glob(PREFIX + "*"):
        name = path.name
        owner = name[len(PREFIX) :].split("-")[0]
        stale = int(owner) in pids if pids is not None and owner.isdigit() else not _owner_alive(name)
        if stale:
            try:
                path.unlink()
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


class ShmSegment:
    """A shared-memory file mapped into this process; ``tensor`` is its bytes (uint8)."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = name
        self.size = size
        self.owner = create
        path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"shared-memory segment {name} is smaller than {size} bytes")
            # MAP_POPULATE: fault every page in now (tmpfs allocation on the owner's side, page
            # tables on the peer's), not during the first transfers.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)  # the mapping keeps the memory; the name stays until unlinked
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        if create:
            atexit.register(self.unlink)

    @classmethod
    def create(cls, size: int) -> ShmSegment:
        sweep_stale_segments()
        return cls(f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}", size, create=True)

    def unlink(self) -> None:
        """Remove the name (mappings stay valid until their processes drop them)."""
        try:
            (SHM_DIR / self.name).unlink()
        except FileNotFoundError:
            pass


def create_shm_pool(layout: KVLayout, num_pages: int) -> KVPool:
    """A CPU KV pool whose buffer is a new shared-memory segment (``pool.segment``)."""
    segment = ShmSegment.create(num_pages * layout.page_bytes)
    pool = KVPool(layout, num_pages, "cpu", memory=segment.tensor)
    pool.segment = segment  # type: ignore[attr-defined]  # kept alive with the pool
    return pool


class ShmKVSender(BaseKVSender):
    """Copies pages into the decode worker's mapped pool, then sends the header."""

    name = "shm"
    MAX_MAPPINGS = 16

    def __init__(self, pool: KVPool, outbox: Outbox) -> None:
        super().__init__(pool)
        self.outbox = outbox
        self._peers: dict[str, tuple[ShmSegment, torch.Tensor]] = {}

    def _peer_pages(self, boot: KVBootstrap) -> torch.Tensor:
        name = boot.endpoint.get("shm_name", "")
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"bootstrap for {boot.rid} names no usable shm segment: {name!r}")
        if name not in self._peers:
            num_pages = int(boot.endpoint.get("num_pages", "0"))
            layout = self.pool.layout
            try:
                segment = ShmSegment(name, num_pages * layout.page_bytes, create=False)
            except OSError as exc:
                raise ValueError(f"cannot map shm segment {name}: {exc}") from exc
            view = KVPool(layout, num_pages, "cpu", memory=segment.tensor).buffer
            if len(self._peers) >= self.MAX_MAPPINGS:
                self._peers.pop(next(iter(self._peers)))
            self._peers[name] = (segment, view)
        return self._peers[name][1]

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
        if src_page_ids:
            dst = self._peer_pages(boot)
            if max(dst_page_ids) >= dst.shape[0] or min(dst_page_ids) <= 0:
                raise ValueError(f"destination pages out of range for {boot.rid}")
            src = self.pool.buffer
            for s, d, n in joint_runs(src_page_ids, dst_page_ids):
                dst[d : d + n].copy_(src[s : s + n])
        header = KVPages(
            rid=boot.rid,
            page_ids=dst_page_ids,
            num_frames=0,
            last=last,
            sent_at=t0,
            first_token=first_token,
            first_logprob=first_logprob,
            finished=finished,
        )
        self.outbox.send(boot.dst_addr, header)
        num_bytes = len(src_page_ids) * self.pool.layout.page_bytes
        self.metrics.record_send(num_bytes, len(src_page_ids), time.time() - t0)

    def close(self) -> None:
        self._peers.clear()


class ShmKVReceiver(BaseKVReceiver):
    """The pages are already in the pool when the header arrives; check and count them."""

    name = "shm"
    one_sided = True

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        segment = getattr(pool, "segment", None)
        if segment is None:
            raise ValueError("the shm receiver needs a pool made by create_shm_pool")
        self.segment: ShmSegment = segment

    def endpoint(self) -> dict[str, str]:
        return {"shm_name": self.segment.name, "num_pages": str(self.pool.allocator.num_pages)}

    def install(self, header: KVPages, frames: Frames | list) -> None:
        if header.num_frames or as_frames(frames).more:
            raise ValueError(f"KV message for {header.rid}: shm transfer carries no frames")
        latency = time.time() - header.sent_at if header.sent_at else None
        num_bytes = len(header.page_ids) * self.pool.layout.page_bytes
        self.metrics.record_install(num_bytes, len(header.page_ids), latency)

    def close(self) -> None:
        self.segment.unlink()


def _receiving_pool(layout: KVLayout, num_pages: int, device: str) -> KVPool:
    if device != "cpu":
        raise ValueError(f"the shm KV transfer backend needs a CPU pool, not {device}")
    return create_shm_pool(layout, num_pages)


BACKEND = KVTransferBackend("shm", ShmKVSender, ShmKVReceiver, _receiving_pool)
