"""Tenant isolation in the radix prefix cache, without a model: a request matches, caches and
pins pages only in its own ``cache_namespace``; the same prompt in another namespace gets no
hit (``cached_len`` 0) and pages of its own; every page is accounted for afterwards."""

from __future__ import annotations

from splitserve.engine.kv_pool import PageAllocator
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams
from splitserve.radix_cache.prefix_cache import RadixPrefixCache

PAGE = 4
PROMPT = list(range(100, 117))  # 17 tokens: 4 full pages are cacheable


def compute(cache: RadixPrefixCache, rid: str, ns: str | None, partial: bool = False) -> Req:
    """Admit ``PROMPT`` in ``ns``, "compute" the rest of it and release it (or, with ``partial``,
    share what it computed while it keeps running)."""
    req = Req(rid, list(PROMPT), SamplingParams(), cache_namespace=ns)
    cache.match(req)
    cache.admitted(req)
    need = -(-req.seq_len // PAGE) - len(req.page_ids)
    req.page_ids += cache.allocator.alloc(need)
    req.kv_len = req.seq_len
    if partial:
        cache.cache_prefix(req)
    else:
        cache.release(req)
    return req


def test_namespaces_never_share_pages() -> None:
    alloc = PageAllocator(64)
    cache = RadixPrefixCache(alloc, PAGE)
    assert compute(cache, "a1", None).cached_len == 0
    assert compute(cache, "a2", None).cached_len == 16  # the cache works
    assert compute(cache, "b1", "tenant-b").cached_len == 0  # same prompt, other namespace
    assert compute(cache, "b2", "tenant-b").cached_len == 16
    assert compute(cache, "c1", "tenant-c").cached_len == 0
    stats = cache.stats()
    assert stats.cached_pages == 12  # 4 pages per namespace, none shared
    assert stats.evictable_pages == 12 and alloc.num_used == 12
    cache.tree.check_integrity()
    assert cache.flush() == 12 and alloc.num_used == 0


def test_cache_prefix_pins_only_in_its_namespace() -> None:
    alloc = PageAllocator(64)
    cache = RadixPrefixCache(alloc, PAGE)
    running = compute(cache, "a", "tenant-a", partial=True)  # still running, pages shared
    assert running.matched_len == 16
    other = compute(cache, "b", "tenant-b")
    assert other.cached_len == 0
    same = compute(cache, "a2", "tenant-a")
    assert same.cached_len == 16
    cache.release(running)
    assert cache.stats().cached_pages == 8 and alloc.num_used == 8
    cache.tree.check_integrity()
