"""The prefix-cache seam the scheduler calls: match a prompt on admission, release a request's
pages when they are no longer needed, evict when the pool is short, flush on demand.

Two implementations, chosen by :func:`create_prefix_cache`: :class:`RadixPrefixCache` (prefill and
colocated workers) and :class:`NoPrefixCache` (cache off, and the decode worker, whose pages come
from KV transfer). Units: lengths in tokens, ``*_pages`` in pages of ``page_size`` tokens.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from splitserve.engine.kv_pool import PageAllocator
from splitserve.engine.request import Req
from splitserve.radix_cache.radix_tree import RadixCache


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


class RadixPrefixCache(BasePrefixCache):
    """Prefix cache on a :class:`RadixCache` whose evictions go back to ``allocator``."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        super().__init__(allocator, page_size)
        self.tree = RadixCache(page_size, allocator)

    def match(self, req: Req) -> None:
        # Leave out the last token: its logits are needed to sample, so it must be computed.
        end = req.seq_len - 1
        nxt = req.next_prompt_logprob
        if nxt is not None:  # prompt logprobs from ``nxt`` on need the logits of ``nxt - 1`` on
            end = min(end, nxt - 1)
        result = self.tree.match_prefix(req.tokens(0, end))
        self.tree.lock(result.last_node)
        req.locked_node = result.last_node
        req.page_ids = list(result.page_ids)
        req.kv_len = req.matched_len = result.matched_len

    def unmatch(self, req: Req) -> None:
        if req.locked_node is not None:
            self.tree.unlock(req.locked_node)
        req.locked_node, req.page_ids, req.kv_len, req.matched_len = None, [], 0, 0

    def release(self, req: Req) -> None:
        ps = self.page_size
        num_full = req.kv_len // ps  # pages whose every token has KV: the only cacheable ones
        to_free = req.page_ids[num_full:]
        if num_full:
            cached_len = self.tree.insert(req.tokens(0, num_full * ps), req.page_ids[:num_full])
            # Pages the tree already had for this span, other than those it lent us: duplicates.
            to_free += req.page_ids[req.matched_len // ps : cached_len // ps]
        if to_free:
            self.allocator.free(to_free)
        if req.locked_node is not None:
            self.tree.unlock(req.locked_node)
        req.locked_node, req.page_ids, req.kv_len, req.matched_len = None, [], 0, 0

    def cache_prefix(self, req: Req) -> None:
        ps = self.page_size
        num_full = req.kv_len // ps
        if num_full * ps <= req.matched_len:
            return  # nothing new since the last call (or the match)
        tokens = req.tokens(0, num_full * ps)
        if self.tree.match_prefix(tokens).matched_len > req.matched_len:
            # Another request cached part of this span meanwhile. Swapping our copies for the
            # tree's would free pages a KV send may still be reading (zero-copy backends), so
            # leave it to :meth:`release`, which runs once the pages are no longer read.
            return
        self.tree.insert(tokens, req.page_ids[:num_full])  # the tree takes our new pages
        result = self.tree.match_prefix(tokens)
        self.tree.lock(result.last_node)  # move the pin down to the new end
        if req.locked_node is not None:
            self.tree.unlock(req.locked_node)
        req.locked_node, req.matched_len = result.last_node, result.matched_len

    def evict(self, num_pages: int) -> int:
        freed = self.tree.evict(num_pages)
        self.evicted_pages += freed
        return freed

    def stats(self) -> CacheStats:
        return CacheStats(
            cached_pages=self.tree.total_pages,
            evictable_pages=self.tree.evictable_pages,
            hit_tokens=self.hit_tokens,
            prompt_tokens=self.prompt_tokens,
            evicted_pages=self.evicted_pages,
        )


PREFIX_CACHES: dict[str, type[BasePrefixCache]] = {"radix": RadixPrefixCache, "none": NoPrefixCache}


def create_prefix_cache(kind: str, allocator: PageAllocator, page_size: int) -> BasePrefixCache:
    """A prefix cache of ``kind`` (a key of :data:`PREFIX_CACHES`).

    Raises:
        ValueError: unknown kind.
    """
    if kind not in PREFIX_CACHES:
        raise ValueError(f"unknown prefix cache {kind!r}: expected one of {sorted(PREFIX_CACHES)}")
    return PREFIX_CACHES[kind](allocator, page_size)
