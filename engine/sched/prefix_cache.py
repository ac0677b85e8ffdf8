"""The prefix-cache seam the scheduler calls: match a prompt on admission, release a request's
pages when they are no longer needed, evict when the pool is short, flush on demand.

The scheduler depends on this interface only. Implementations are chosen by name
(``splitserve.config.registry.PREFIX_CACHE``): :class:`NoPrefixCache` here (cache off, and the
decode worker, whose pages come from KV transfer) and
:class:`splitserve.radix_cache.prefix_cache.RadixPrefixCache` (prefill and colocated workers).
Units: lengths in tokens, ``*_pages`` in pages of ``page_size`` tokens.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from splitserve.engine.kv_pool import PageAllocator
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import KVEvent, TierStats


@dataclass(slots=True)
class CacheStats:
    """Counters of one worker's prefix cache, since start (tokens / pages)."""

    cached_pages: int = 0  # pages owned by the cache (locked or not)
    evictable_pages: int = 0  # of those, pages no running request pins
    hit_tokens: int = 0  # prompt tokens served from the cache at admission
    prompt_tokens: int = 0  # prompt tokens admitted (the hit-rate denominator)
    evicted_pages: int = 0  # pages freed by eviction or flush


class BasePrefixCache(abc.ABC):
    """What the scheduler needs from a prefix cache.

    Page ownership: while a request runs, ``req.page_ids[:req.matched_len // page_size]`` belong
    to the cache (pinned by ``req.locked_node``); the rest belong to the request. After
    :meth:`release` the request owns no pages.
    """

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.evicted_pages = 0

    @abc.abstractmethod
    def match(self, req: Req) -> None:
        """Admission of a request that holds no pages: point ``req.page_ids`` at the cached pages
        of its longest cached prefix, lock them, and set ``req.kv_len = req.matched_len`` to the
        matched length (a multiple of ``page_size``, and shorter than the sequence, so at least
        one token is computed and new KV never lands in a cached page; short of every position
        whose logits score a requested prompt logprob)."""

    @abc.abstractmethod
    def unmatch(self, req: Req) -> None:
        """Undo :meth:`match` of a request that could not be admitted after all (no KV was
        written): unlock, drop the borrowed pages, ``kv_len = 0``."""

    @abc.abstractmethod
    def release(self, req: Req) -> None:
        """The request no longer needs its pages (finished, aborted, retracted, KV sent).

        Caches the first ``req.kv_len`` tokens where possible, frees every page the cache did not
        take (duplicates of cached pages, a partial last page, unused pages), unlocks, and leaves
        the request with no pages and ``kv_len == 0``.
        """

    def cache_prefix(self, req: Req) -> None:
        """Share what ``req`` has computed so far while it keeps running: cache its full pages
        of KV (``req.kv_len`` tokens, rounded down to pages) and pin them for ``req``, so that
        requests admitted next reuse them before ``req`` is released (concurrent requests with
        a common prefix; a prompt whose KV is still being sent). Afterwards
        ``req.matched_len`` covers those pages. The default does nothing."""

    @abc.abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` unpinned cached pages if there are that many; returns pages
        freed."""

    def ensure_free(self, num_pages: int) -> bool:
        """Evict until ``num_pages`` pages are free; whether they are (check-then-act)."""
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.evict(short)
        return self.allocator.can_alloc(num_pages)

    def flush(self) -> int:
        """Drop every unpinned entry; returns pages freed."""
        return self.evict(self.stats().evictable_pages)

    @abc.abstractmethod
    def stats(self) -> CacheStats:
        """Current sizes and counters."""

    # ---- tiers below the pool (radix_cache.tiers); a cache without them keeps the defaults ----

    identity: str = ""  # the block keys' model identity (KV events); "": publishes none
    store_url: str = ""  # the shared store its blocks may be in ("": none)

    def prefetch(self, req: Req) -> None:
        """A new request was queued: start bringing what lower tiers hold of its prompt back
        towards the pool while other requests compute. The default has no tiers."""

    def ready(self, req: Req) -> bool:
        """Whether ``req`` may be matched now: no load of its prompt is still running (a
        request whose load is not done waits; the others are scheduled past it)."""
        return True

    @property
    def is_loading(self) -> bool:
        """Whether any load is running (the worker polls for it instead of idling)."""
        return False

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A forward pass computed ``num_tokens`` prompt tokens in ``seconds`` (the prefill rate
        that loads are weighed against)."""

    def prefill_rate(self) -> float:
        """The measured prefill rate (tokens/s; 0: not measured)."""
        return 0.0

    def drain_events(self) -> list[KVEvent]:
        """Changes of where blocks live since the last call (KV events for the router)."""
        return []

    def snapshot_events(self) -> list[KVEvent]:
        """Every block held now, as ``stored`` events per tier."""
        return []

    def tier_stats(self) -> list[TierStats]:
        """One row per tier (empty without tiers)."""
        return []

    def close(self) -> None:
        """Stop background I/O (finishing queued writes)."""

    def admitted(self, req: Req) -> None:
        """Count a matched request that was admitted; on a first admission (no output yet) set
        ``req.cached_len``, the prompt tokens reported to the client as cached."""
        if not req.output_ids:  # a retracted request's re-admission is not a new prompt
            req.cached_len = min(req.matched_len, req.prompt_len)
            self.hit_tokens += req.cached_len
            self.prompt_tokens += req.prompt_len


class NoPrefixCache(BasePrefixCache):
    """Cache off: every request computes its whole sequence and frees all its pages."""

    def match(self, req: Req) -> None:
        req.kv_len = req.matched_len = 0

    def unmatch(self, req: Req) -> None:
        req.kv_len = 0

    def release(self, req: Req) -> None:
        if req.page_ids:
            self.allocator.free(req.page_ids)
        req.page_ids, req.kv_len, req.matched_len = [], 0, 0

    def evict(self, num_pages: int) -> int:
        return 0

    def stats(self) -> CacheStats:
        return CacheStats(hit_tokens=self.hit_tokens, prompt_tokens=self.prompt_tokens)
