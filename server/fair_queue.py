"""Weighted fair queueing over tenants by deficit round robin.

:class:`FairQueue` holds items (requests waiting for a slot on the workers) in one FIFO per
tenant and hands them out by deficit round robin (M. Shreedhar and G. Varghese, "Efficient Fair
Queueing using Deficit Round Robin", SIGCOMM 1995 / IEEE/ACM ToN 4(3), 1996): the tenants with
items waiting form a ring; a tenant at the head of the ring is granted ``quantum * weight`` of
credit (its *deficit counter*) once per visit and is served while its next item's cost fits the
credit, then the ring moves on. A tenant whose queue empties leaves the ring and loses its
credit, so idle time is never banked. Over any stretch in which two tenants both have items
waiting, the costs served to each differ from their weights' ratio by at most one item's cost
plus one quantum (the paper's Theorem 1): a tenant that floods the queue with 50 requests
delays a tenant that sends one by at most one item per other tenant ahead of it in the ring.

When the queue is bounded, fairness must hold for its places too, or a tenant that keeps it
full shuts the others out before any scheduling happens: :meth:`FairQueue.heaviest` names the
tenant with the longest queue for its weight, whose newest item a full queue drops to make room
for a lighter tenant's (longest queue drop: B. Suter, T. V. Lakshman, D. Stiliadis and A. K.
Choudhury, "Design Considerations for Supporting TCP with Per-flow Queueing", INFOCOM 1998).

``fair=False`` puts every item in one queue, whatever its tenant: first come, first served
(the baseline ``bench/overload.py`` measures against).

Pure data: no clock, no event loop, no locks (the router's event loop is its only caller).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")

_ONE_QUEUE = "\0fifo"  # the single tenant key of fair=False


class FairQueue(Generic[T]):
    """Items per tenant, handed out by weighted deficit round robin.

    Args:
        weight: a tenant's weight (> 0; default 1 for all): its share of the items served
            while every tenant has some waiting is proportional to it.
        quantum: credit per visit at weight 1, in the units of the items' cost (requests: 1).
        fair: False: one FIFO for every tenant (no fairness).

    Raises:
        ValueError: ``quantum`` <= 0 (at construction) or a weight <= 0 (when its tenant's
            first item is pushed).
    """

    def __init__(self, weight: Callable[[Hashable], float] = lambda tenant: 1.0,
                 quantum: float = 1.0, fair: bool = True) -> None:
        if quantum <= 0:
            raise ValueError(f"quantum must be positive, not {quantum}")
        self.weight, self.quantum, self.fair = weight, quantum, fair
        self._queues: dict[Hashable, collections.deque[tuple[T, float]]] = {}
        self._deficit: dict[Hashable, float] = {}
        self._ring: collections.deque[Hashable] = collections.deque()  # tenants with items
        self._granted = False  # the ring's head got its quantum for the current visit
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def queued(self, tenant: Hashable) -> int:
        """Items ``tenant`` has waiting."""
        return len(self._queues.get(self._key(tenant), ()))

    def heaviest(self) -> tuple[Hashable, float] | None:
        """The tenant with the most items waiting per unit of weight, and that backlog
        (items / weight); None when empty. Ties: the one longest in the ring."""
        best = None
        for key in self._ring:
            weight = self.weight(key) if self.fair else 1.0
            load = len(self._queues[key]) / weight
            if best is None or load > best[1]:
                best = (key, load)
        return best

    def backlog(self, tenant: Hashable, extra: int = 0) -> float:
        """``tenant``'s items waiting (plus ``extra``) per unit of its weight."""
        weight = self.weight(tenant) if self.fair else 1.0
        return (self.queued(tenant) + extra) / weight

    def pop_newest(self, tenant: Hashable) -> T | None:
        """Take ``tenant``'s most recently pushed item out (None if it has none)."""
        key = self._key(tenant)
        queue = self._queues.get(key)
        if not queue:
            return None
        item, _ = queue.pop()
        self._len -= 1
        if not queue:
            self._drop(key)
        return item

    def push(self, tenant: Hashable, item: T, cost: float = 1.0) -> None:
        """Queue ``item`` behind ``tenant``'s others; a tenant with none joins the ring's tail.

        Raises:
            ValueError: ``cost`` <= 0, or ``tenant``'s weight <= 0.
        """
        if cost <= 0:
            raise ValueError(f"cost must be positive, not {cost}")
        key = self._key(tenant)
        queue = self._queues.get(key)
        if queue is None:
            if self.fair and not self.weight(tenant) > 0:
                raise ValueError(f"tenant {tenant!r}: weight must be positive, not "
                                 f"{self.weight(tenant)}")
            queue = self._queues[key] = collections.deque()
            self._deficit[key] = 0.0
            self._ring.append(key)
        queue.append((item, cost))
        self._len += 1

    def pop(self) -> T | None:
        """The next item by deficit round robin (None when empty); it leaves the queue."""
        ring = self._ring
        while ring:
            key = ring[0]
            if not self._granted:
                weight = self.weight(key) if self.fair else 1.0
                self._deficit[key] += self.quantum * weight
                self._granted = True
            queue = self._queues[key]
            item, cost = queue[0]
            if self._deficit[key] >= cost:
                self._deficit[key] -= cost
                queue.popleft()
                self._len -= 1
                if not queue:
                    self._drop(key)
                return item
            ring.rotate(-1)  # its credit is spent for this round: the next tenant's visit
            self._granted = False
        return None

    def remove(self, tenant: Hashable, item: T) -> bool:
        """Take ``item`` (compared by identity) out of ``tenant``'s queue; False if it is not
        there. A tenant left with nothing leaves the ring and its credit."""
        key = self._key(tenant)
        queue = self._queues.get(key)
        if queue is None:
            return False
        for i, (queued, _) in enumerate(queue):
            if queued is item:
                del queue[i]
                self._len -= 1
                if not queue:
                    self._drop(key)
                return True
        return False

    def _key(self, tenant: Hashable) -> Hashable:
        return tenant if self.fair else _ONE_QUEUE

    def _drop(self, key: Hashable) -> None:
        """``key``'s queue is empty: it leaves the ring, its queue and its credit."""
        if self._ring[0] == key:
            self._ring.popleft()
            self._granted = False
        else:
            self._ring.remove(key)
        del self._queues[key]
        del self._deficit[key]
