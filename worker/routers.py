"""A worker's view of the routers (API servers) it serves requests for: which are still there.

A request belongs to the router whose inbox is its ``reply_addr``; several routers may share one
worker (behind a load balancer, each sends its own tasks). When a router goes, its requests
have nobody left to stream to, and finishing them would hold their KV pages (for a long
generation, minutes) for nothing. Two signs that it went:

- its link dropped: this worker's ZeroMQ link to that inbox closed (the router process died or
  exited; ``Outbox.link_drops``): seen at once;
- silence: no ``RouterBeat`` (nor any other message from it) for the ``dead_after_s`` it
  announced in its beats: a partition, or a hung router. The router declares this worker dead
  after the same bound, so both ends of a cut link give up within one ``--dead-after``.

A router that never sent a ``RouterBeat`` (a test harness driving a worker directly) is timed
out by its link only. A worker loop that itself stalled (a long step) credits the stall to
every router, as the router does for its workers: the beats that came meanwhile are still
unread behind other messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

CHECK_S = 0.25  # how often the worker loop asks which routers are gone
STALL_S = 1.0  # a gap between checks longer than this is this loop's stall, not the router's


@dataclass(slots=True)
class _Router:
    last_heard: float
    dead_after_s: float | None = None  # from its RouterBeat; None: timed out by its link only
    drops: int = 0  # link drops already acted on


class RouterWatch:
    """The routers a worker heard from, by inbox address.

    Args:
        link_drops: ``Outbox.link_drops``: how often the link to an address dropped.
        watch: ``Outbox.watch``: start counting an address's link drops.
        clock: seconds (the worker's clock, which tests replace).
    """

    def __init__(
        self,
        link_drops: Callable[[str], int],
        watch: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._link_drops = link_drops
        self._watch = watch
        self._clock = clock
        self._routers: dict[str, _Router] = {}
        self._last_check = clock()

    def heard(self, addr: str, dead_after_s: float | None = None) -> None:
        """A message came from the router at ``addr`` (``dead_after_s``: a ``RouterBeat``'s)."""
        now = self._clock()
        r = self._routers.get(addr)
        if r is None:
            self._watch(addr)  # connect now, so a drop before the first reply is seen too
            r = self._routers[addr] = _Router(now, drops=self._link_drops(addr))
        r.last_heard = now
        if dead_after_s is not None:
            r.dead_after_s = dead_after_s

    def dropped(self, addr: str) -> bool:
        """The link to ``addr`` dropped since the last call that said so: the router process
        that sent the requests held for ``addr`` is gone (a new one at the same address sends
        new requests, which this does not touch once it has returned True)."""
        r = self._routers.get(addr)
        if r is None:
            return False
        n = self._link_drops(addr)
        if n > r.drops:
            r.drops = n
            return True
        return False

    def gone(self, now: float, addrs: Iterable[str]) -> list[tuple[str, str]]:
        """Which of the routers ``addrs`` (those with requests held here) are gone, each with
        why, in words."""
        stall = now - self._last_check
        self._last_check = now
        if stall > STALL_S:
            for r in self._routers.values():
                r.last_heard += stall
        out = []
        for addr in addrs:
            r = self._routers.get(addr)
            if r is None:
                continue
            if self.dropped(addr):
                out.append((addr, "closed its link"))
            elif r.dead_after_s is not None and now - r.last_heard > r.dead_after_s:
                out.append((addr, f"sent nothing for {r.dead_after_s:g} s"))
        return out
