"""Strict priority classes over fair queues: the router's waiting room.

A request's ``priority`` (vLLM's request field: an int, lower first, default 0) picks its
class; each class is a :class:`~splitserve.server.fair_queue.FairQueue` over tenants. The next
request admitted is the fair queue's choice within the **most urgent class that has any
waiting**, so priority orders requests across the whole cluster as it does inside a worker's
scheduler (``engine/sched/scheduler.py``), and tenants share each class by their weights. With
every priority equal (the default) this is exactly one fair queue, as before.

When the room is full, the place given up is in the **least urgent class** that has requests
waiting, taken from its heaviest tenant (longest queue drop, within the class).

Pure data, like ``FairQueue``: no clock, no event loop, no locks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from splitserve.server.fair_queue import FairQueue

T = TypeVar("T")


class PriorityClasses(Generic[T]):
    """Waiting items by ``(priority, tenant)``: strict priority between classes (lower value
    first), weighted deficit round robin between tenants inside one.

    Args:
        make: a new empty ``FairQueue`` for a class (each class gets its own, so credit in one
            class never buys a place in another).
    """

    def __init__(self, make: Callable[[], FairQueue[T]]) -> None:
        self._make = make
        self._classes: dict[int, FairQueue[T]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, priority: int, tenant: Hashable, item: T) -> None:
        """Queue ``item`` in class ``priority`` behind ``tenant``'s others there.

        Raises:
            ValueError: ``tenant``'s weight is not positive (``FairQueue.push``).
        """
        queue = self._classes.get(priority)
        if queue is None:
            queue = self._classes[priority] = self._make()
        queue.push(tenant, item)
        self._len += 1

    def pop(self) -> T | None:
        """The next item: from the most urgent class with any waiting, by its fair queue;
        None when empty."""
        if not self._classes:
            return None
        priority = min(self._classes)
        item = self._classes[priority].pop()
        self._took(priority)
        return item

    def remove(self, priority: int, tenant: Hashable, item: T) -> bool:
        """Take ``item`` (by identity) out of its class; False if it is not waiting."""
        queue = self._classes.get(priority)
        if queue is None or not queue.remove(tenant, item):
            return False
        self._took(priority)
        return True

    def most_urgent(self) -> int | None:
        """The smallest ``priority`` with items waiting (None when empty): the next class
        served."""
        return min(self._classes) if self._classes else None

    def least_urgent(self) -> int | None:
        """The largest ``priority`` with items waiting (None when empty): where a full room
        takes a place back."""
        return max(self._classes) if self._classes else None

    def heaviest(self, priority: int) -> tuple[Hashable, float] | None:
        """Class ``priority``'s tenant with the most waiting per unit of weight, and that
        backlog (``FairQueue.heaviest``); None if the class is empty."""
        queue = self._classes.get(priority)
        return None if queue is None else queue.heaviest()

    def backlog(self, priority: int, tenant: Hashable, extra: int = 0) -> float:
        """``tenant``'s items waiting in class ``priority`` (plus ``extra``) per unit of its
        weight."""
        queue = self._classes.get(priority)
        if queue is None:
            queue = self._make()  # empty: only its weight rule is read
        return queue.backlog(tenant, extra)

    def pop_newest(self, priority: int, tenant: Hashable) -> T | None:
        """Take ``tenant``'s most recently pushed item of class ``priority`` out (None if it
        has none there)."""
        queue = self._classes.get(priority)
        item = None if queue is None else queue.pop_newest(tenant)
        if item is not None:
            self._took(priority)
        return item

    def _took(self, priority: int) -> None:
        """One item left class ``priority``: count it, and drop the class once empty."""
        self._len -= 1
        if not self._classes[priority]:
            del self._classes[priority]
