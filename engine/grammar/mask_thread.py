"""Fills the grammar mask of a step on a background thread while the model runs its forward pass.

Why it is safe without a lock on grammar state — the ordering ``ModelRunner.run`` keeps:

1. The worker's own thread owns every ``RequestGrammar``: it creates the matchers (compile poll),
   accepts sampled tokens, jumps forward, checks ``must_end``, and the decode worker replays the
   prefill worker's first token — all outside ``ModelRunner.run``.
2. ``run`` starts the fill only after all of those for the previous step are done (they follow
   ``run``'s return), then runs only the forward pass and prompt logprobs, which touch no grammar.
3. ``run`` joins the fill before it applies the mask and samples, and joins in a ``finally``, so a
   fill never outlives the step that started it, even when the forward pass raises.
4. The fill only reads the matchers (``fill_bitmask`` does not advance them) and writes only the
   runner's ``BatchMask`` buffers, which the worker thread reads after the join
   (``Future.result`` orders the two threads' memory).

Grammar compiles run on the ``GrammarService`` threads and never touch a matcher.

Cores: one thread, busy for well under a millisecond per constrained row per step. It runs no
torch intra-op parallel work (xgrammar's fill is C++, the bias expansion is numpy), so it adds
exactly one runnable thread next to torch's intra-op threads. xgrammar (via tvm-ffi), numpy's
``take`` and torch's kernels release the GIL, so the fill proceeds while the forward pass computes.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class MaskFillThread:
    """One fill in flight at most, on one lazily started thread (workers without constrained
    requests never start it)."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def start(self, fill: Callable[[], None]) -> None:
        """Run ``fill`` on the background thread.

        Raises:
            RuntimeError: if the previous fill was not joined (the ordering above is broken).
        """
        if self._pending is not None:
            raise RuntimeError("a grammar mask fill is still in flight")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._pending = self._executor.submit(fill)

    def join(self) -> None:
        """Wait for the fill started last, if any. Re-raises its exception."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Join any fill in flight and stop the thread."""
        try:
            self.join()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
