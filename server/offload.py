"""CPU work of a request, off the event loop: parsing its body, rendering the chat template,
tokenizing, planning its constraint, validating a finished output.

The event loop also streams every other request's tokens; work done on it delays them all (a
4 MB prompt tokenized on the loop froze every stream for seconds). :class:`Offload` runs such
work on a few threads, bounded. Threads, not processes, measured on 2 cores (a ticker thread
standing in for the loop, its longest gap while another thread works; the end-to-end figure,
a stream's largest gap while 4 MB bodies arrive, is ``bench/stream_gap.py``'s): the Rust tokenizer releases the GIL while it encodes (4 MB: 18 s of work, the ticker's
longest gap 0.45 s, from handing back a million ids; 160 kB: 0.36 s, gap 20 ms), and the
pure-Python parts (Jinja rendering: 22 ms for a 4 MB message, gap 44 ms; ``jsonschema``)
hold it only between the interpreter's switches (5 ms), so the loop keeps its turn. A process
pool would add a copy of every prompt and its ids each way, for nothing the threads do not
give. What bounds the tokenizer's share is that a prompt far over the context is refused from
its byte length before it is tokenized (``server.prompt_bound``).

Bounded twice: at most ``num_threads`` jobs run at once, and at most ``max_pending`` wait or
run; past that a request gets 503 with ``Retry-After`` at once instead of a queue that grows
with the load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from splitserve.server.errors import APIError

T = TypeVar("T")


class Offload:
    """Runs blocking calls on worker threads for async code.

    Args:
        num_threads: calls that run at once (the server's CPU share for request preparation).
        max_pending: calls that may run or wait at once; one more is refused (503).
    """

    def __init__(self, num_threads: int = 2, max_pending: int = 64) -> None:
        if num_threads < 1 or max_pending < num_threads:
            raise ValueError(f"need 1 <= num_threads <= max_pending, got {num_threads}, "
                             f"{max_pending}")
        self.num_threads = num_threads
        self.max_pending = max_pending
        self.pending = 0
        self._limiter: anyio.CapacityLimiter | None = None  # made on the loop, at first use

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread; its result (or its exception).

        Raises:
            APIError: 503 when ``max_pending`` calls are already running or waiting.
        """
        if self.pending >= self.max_pending:
            raise APIError(f"the server is busy preparing {self.pending} requests; retry "
                           "shortly", status_code=503, code="server_busy")
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.num_threads)
        self.pending += 1
        try:
            # Not abandoned on cancellation: the thread's result is dropped when it ends.
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        finally:
            self.pending -= 1
