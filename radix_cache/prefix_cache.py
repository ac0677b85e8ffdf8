"""The radix-tree prefix cache: :class:`RadixPrefixCache` implements the scheduler's
:class:`~splitserve.engine.sched.prefix_cache.BasePrefixCache` on a
:class:`~splitserve.radix_cache.radix_tree.RadixCache` (prefill and colocated workers).
Units: lengths in tokens, ``*_pages`` in pages of ``page_size`` tokens.
"""

from __future__ import annotations

from splitserve.config.registry import PREFIX_CACHE
from splitserve.engine.kv_pool import PageAllocator
from splitserve.engine.sched.prefix_cache import BasePrefixCache, CacheStats
from splitserve.engine.sched.request import Req
from splitserve.radix_cache.radix_tree import RadixCache


class RadixPrefixCache(BasePrefixCache):
    """Prefix cache on a :class:`RadixCache` whose evictions go back to ``allocator``.

    Each request matches and inserts only in its own ``req.cache_namespace`` (tenant isolation:
    another namespace's entries are never lent to it, nor counted as its cached tokens)."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        super().__init__(allocator, page_size)
        self.tree = RadixCache(page_size, allocator)

    @staticmethod
    def match_end(req: Req) -> int:
        """Tokens of ``req`` a match may cover: all but the last (its logits are needed to
        sample, so it must be computed), and none whose prompt logprob is still wanted."""
        end = req.seq_len - 1
        nxt = req.next_prompt_logprob
        if nxt is not None:  # prompt logprobs from ``nxt`` on need the logits of ``nxt - 1`` on
            end = min(end, nxt - 1)
        return end

    def match(self, req: Req) -> None:
        result = self.tree.match_prefix(req.tokens(0, self.match_end(req)), req.cache_namespace)
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
            cached_len = self.insert(req.tokens(0, num_full * ps), req.page_ids[:num_full],
                                     req.cache_namespace)
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
        ns = req.cache_namespace
        if self.tree.match_prefix(tokens, ns).matched_len > req.matched_len:
            # Another request cached part of this span meanwhile. Swapping our copies for the
            # tree's would free pages a KV send may still be reading (zero-copy backends), so
            # leave it to :meth:`release`, which runs once the pages are no longer read.
            return
        self.insert(tokens, req.page_ids[:num_full], ns)  # the tree takes our new pages
        result = self.tree.match_prefix(tokens, ns)
        self.tree.lock(result.last_node)  # move the pin down to the new end
        if req.locked_node is not None:
            self.tree.unlock(req.locked_node)
        req.locked_node, req.matched_len = result.last_node, result.matched_len

    def insert(self, tokens: list[int], page_ids: list[int], namespace: str | None) -> int:
        """Cache ``tokens`` with their pages (``RadixCache.insert``); returns the length that
        was already cached. Every insert goes through here (tiers copy the new pages down)."""
        return self.tree.insert(tokens, page_ids, namespace)

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


def create_prefix_cache(kind: str, allocator: PageAllocator, page_size: int) -> BasePrefixCache:
    """A prefix cache of ``kind`` (``splitserve.config.registry.PREFIX_CACHE``: radix | none).

    Raises:
        ValueError: unknown kind.
    """
    return PREFIX_CACHE.load(kind)(allocator, page_size)
