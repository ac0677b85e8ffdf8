"""Pages of failed requests that a prefill worker may still be writing (one-sided backends).

With shm, mooncake and nixl the prefill worker writes straight into the decode worker's pool, so when
a request fails on the decode side before its last ``KVPages`` arrived, its reserved pages cannot
be reused at once: a write may still be on its way. The decode worker sends ``KVFailed`` with an
``ack_addr``; the prefill worker stops writing that request (skipping queued writes, waiting out
the one in flight) and answers ``KVReleased``. Only then are the pages freed: exact, whatever
the prefill worker's speed.

Without an answer the pages stay fenced until one of two things:

- the prefill worker is known gone: the decode worker's ZeroMQ link to it dropped after the
  bootstrap was sent (``Outbox.link_drops``; the same signal the router uses to declare a worker
  dead). A dead process writes nothing, so its pages are freed at once;
- ``deadline`` passes (the transfer timeout after the failure). This covers a prefill worker
  that is hung with its link up (SIGSTOP, a stuck step). If it wakes up later and finishes a
  write it had started, that write lands in reused pages: a time bound, not a guarantee, like
  the fixed 3 s quarantine this replaced, but 10x longer by default and only for a worker that
  stopped answering. Holding the pages for ever instead would leak them on every hung worker.
  Caveat: between hosts, a link drop while the process lives (a network partition) is taken for
  a dead worker too; its one-sided writes would then have to cross the same partition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from splitserve.engine.sched.request import Req


@dataclass(slots=True)
class Fence:
    """A failed request whose pages wait for the prefill worker's ``KVReleased``."""

    req: Req
    prefill_addr: str
    deadline: float  # time.monotonic() after which the pages are freed without the ack
    link_drops: int  # Outbox.link_drops(prefill_addr) when the bootstrap was sent


class KVFences:
    """Fenced requests by rid (a rid is normally fenced once; a repeat is kept, not lost)."""

    def __init__(self) -> None:
        self._by_rid: dict[str, list[Fence]] = {}

    def __len__(self) -> int:
        return sum(len(f) for f in self._by_rid.values())

    def __contains__(self, rid: str) -> bool:
        return rid in self._by_rid

    @property
    def num_pages(self) -> int:
        """Pages held by fenced requests."""
        return sum(len(f.req.page_ids) for fs in self._by_rid.values() for f in fs)

    def add(self, fence: Fence) -> None:
        self._by_rid.setdefault(fence.req.rid, []).append(fence)

    def release(self, rid: str) -> list[Req]:
        """The requests of ``rid`` (acknowledged: their pages may be freed); [] if none."""
        return [f.req for f in self._by_rid.pop(rid, [])]

    def pop_where(self, cond: Callable[[Fence], bool]) -> list[Fence]:
        """Remove and return the fences for which ``cond`` holds (deadline passed, peer gone)."""
        out = []
        for rid in list(self._by_rid):
            keep = [f for f in self._by_rid[rid] if not cond(f)]
            out += [f for f in self._by_rid[rid] if cond(f)]
            if keep:
                self._by_rid[rid] = keep
            else:
                del self._by_rid[rid]
        return out

    def peers(self) -> set[str]:
        """The prefill workers that owe an acknowledgement."""
        return {f.prefill_addr for fs in self._by_rid.values() for f in fs}
