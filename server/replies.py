"""One request's replies on the router, in delivery order, for its one reader."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class Replies:
    """The part of an ``asyncio.Queue`` that one request's reader uses (unbounded, one waiter),
    at a fraction of the CPU per token: :meth:`put_nowait` from the inbox reader's callback,
    :meth:`get` from the request's async generator. Call both from the event loop's thread."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, item: Any) -> None:
        """Append ``item`` and wake the reader if it waits."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Any:
        """The oldest item, waiting for one if there is none."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()
