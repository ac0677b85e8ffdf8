"""Which adapter sits in which of a worker's ``--max-loras`` slots, as plain bookkeeping (no
tensors): reference counts, least-recent use, pins, and the slot being drained for a waiting
adapter.

A request holds a reference on its adapter's slot from its admission to the release of its
pages (``engine.sched.scheduler``), so a slot in use is never overwritten. An adapter that is
not resident takes a free slot, else the least recently used idle one that is not pinned
(S-LoRA's and SGLang's LRU). When every slot is in use, the scheduler names the adapters its
waiting requests need (:meth:`LoraSlots.want`) and the least recently used unpinned slot is
*drained*: it takes no new reference, so its requests finish and the waiting adapter gets it.
Without the drain, a steady stream of requests for resident adapters would keep the others
waiting forever (``--max-loras 1`` with alternating adapters). Requests of other adapters keep
running meanwhile: a waiting request blocks nobody.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass


@dataclass(slots=True)
class Slot:
    """One slot. ``adapter``: its adapter's name (None: empty); ``refs``: requests holding it;
    ``last_used``: the use counter at its last acquisition; ``pinned``: never evicted;
    ``draining``: takes no new reference until it is evicted (or the want goes away);
    ``retired``: its adapter was unloaded: emptied once ``refs`` is 0."""

    adapter: str | None = None
    refs: int = 0
    last_used: int = 0
    pinned: bool = False
    draining: bool = False
    retired: bool = False


class LoraSlots:
    """The slots of one worker.

    Adapters are named by a key unique to each load (a reload under the same name is another
    adapter: its old slot serves the requests that were admitted under it, then empties).

    Args:
        num_slots: ``--max-loras``, at least 1.
        clear: called as ``clear(slot)`` when ``slot`` is emptied (also before another adapter
            is installed there).
    """

    def __init__(self, num_slots: int, clear: Callable[[int], None]) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras must be at least 1, not {num_slots}")
        self.slots = [Slot() for _ in range(num_slots)]
        self._clear = clear
        self._uses = itertools.count(1)
        self.num_evictions = 0

    def find(self, name: str) -> int | None:
        """The slot ``name`` sits in (not retired: a retired slot takes no new reference), or
        None."""
        for i, s in enumerate(self.slots):
            if s.adapter == name and not s.retired:
                return i
        return None

    def resident(self) -> list[str]:
        """The adapters in a slot, in slot order."""
        return [s.adapter for s in self.slots if s.adapter is not None and not s.retired]

    def acquire(self, name: str, install: Callable[[int], None]) -> int | None:
        """A reference on ``name``'s slot, installing it first if it is not resident (into an
        empty slot, else the least recently used idle unpinned one, a drained one first:
        ``install(slot)`` copies its weights in); None when every slot is in use or pinned,
        or ``name``'s own slot is draining."""
        i = self.find(name)
        if i is None:
            i = self._free_slot()
            if i is None:
                return None
            s = self.slots[i]
            if s.adapter is not None:
                self._clear(i)
                self.num_evictions += 1
            install(i)
            self.slots[i] = s = Slot(adapter=name)
        s = self.slots[i]
        if s.draining:
            return None
        s.refs += 1
        s.last_used = next(self._uses)
        return i

    def release(self, slot: int) -> None:
        """Give back a reference from :meth:`acquire`; a retired adapter's slot empties with
        its last reference."""
        s = self.slots[slot]
        if s.refs <= 0:
            raise ValueError(f"slot {slot} released more often than acquired")
        s.refs -= 1
        if s.refs == 0 and s.retired:
            self._empty(slot)

    def want(self, names: Collection[str]) -> None:
        """The adapters that requests are waiting for (none resident): when no slot could take
        one now, drain the least recently used unpinned slot; with none wanted, stop draining.
        The scheduler calls this at each admission pass."""
        if not names:
            for s in self.slots:
                s.draining = False
            return
        if any(s.draining for s in self.slots) or self._free_slot() is not None:
            return
        unpinned = [(s.last_used, i) for i, s in enumerate(self.slots) if not s.pinned]
        if unpinned:
            self.slots[min(unpinned)[1]].draining = True

    def pin(self, name: str, install: Callable[[int], None]) -> int | None:
        """Install ``name`` (if it is not resident) and pin it there; None when no slot can
        take it now, or pinning it would leave no unpinned slot."""
        pinned = sum(s.pinned for s in self.slots)
        i = self.find(name)
        if i is not None and self.slots[i].pinned:
            return i
        if pinned + 1 >= len(self.slots):
            return None
        i = self.acquire(name, install)
        if i is None:
            return None
        s = self.slots[i]
        s.refs -= 1
        s.pinned, s.draining = True, False
        return i

    def retire(self, name: str) -> None:
        """``name`` was unloaded: its slot empties now if idle, else with its last reference
        (the requests admitted under it finish under it)."""
        i = self.find(name)
        if i is None:
            return
        s = self.slots[i]
        s.retired, s.pinned = True, False
        if s.refs == 0:
            self._empty(i)

    def _empty(self, i: int) -> None:
        self._clear(i)
        self.slots[i] = Slot()

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used idle unpinned one (a draining one
        first: it was drained for this), else None."""
        for i, s in enumerate(self.slots):
            if s.adapter is None:
                return i
        idle = [(not s.draining, s.last_used, i) for i, s in enumerate(self.slots)
                if s.refs == 0 and not s.pinned]
        return min(idle)[2] if idle else None
