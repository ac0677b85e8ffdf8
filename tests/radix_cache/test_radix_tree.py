"""RadixCache: unit tests per operation, then a property test against a naive reference model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from splitserve.engine.kv_pool import PageAllocator
from splitserve.radix_cache.radix_tree import MatchResult, RadixCache


def _cache(page_size: int = 1, num_pages: int = 64) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    return RadixCache(page_size, alloc), alloc


def _insert(cache: RadixCache, alloc: PageAllocator, tokens: list[int], ns: str | None = None):
    """Insert like a worker does: fresh pages for the whole key, free the duplicates."""
    n = len(tokens) // cache.page_size
    pages = alloc.alloc(n)
    cached_len = cache.insert(tokens, pages, ns)
    alloc.free(pages[: cached_len // cache.page_size])
    return pages, cached_len


def test_insert_then_match_returns_pages() -> None:
    cache, alloc = _cache()
    pages, cached_len = _insert(cache, alloc, [1, 2, 3])
    assert cached_len == 0
    m = cache.match_prefix([1, 2, 3, 4])
    assert (m.page_ids, m.matched_len) == (pages, 3)
    assert cache.match_prefix([1, 2]).page_ids == pages[:2]
    assert cache.match_prefix([9]).matched_len == 0
    assert cache.total_pages == cache.evictable_pages == 3
    cache.check_integrity()


def test_insert_returns_cached_len_and_keeps_tree_pages() -> None:
    cache, alloc = _cache()
    first, _ = _insert(cache, alloc, [1, 2, 3])
    second, cached_len = _insert(cache, alloc, [1, 2, 5, 6])
    assert cached_len == 2
    assert cache.match_prefix([1, 2, 5, 6]).page_ids == first[:2] + second[2:]
    assert cache.match_prefix([1, 2, 3]).page_ids == first
    assert cache.total_pages == 5 and alloc.num_used == 5
    cache.check_integrity()


def test_page_alignment() -> None:
    cache, alloc = _cache(page_size=4)
    assert cache.insert([1, 2, 3], []) == 0  # under one page: nothing cached
    pages, _ = _insert(cache, alloc, list(range(10)))  # 2 whole pages; tokens 8, 9 dropped
    assert len(pages) == 2 and cache.total_pages == 2
    m = cache.match_prefix(list(range(7)) + [99])
    assert (m.page_ids, m.matched_len) == (pages[:1], 4)
    assert cache.match_prefix(list(range(12))).matched_len == 8
    # diverging inside the second page splits the edge at the page boundary
    other, cached_len = _insert(cache, alloc, [0, 1, 2, 3, 4, 5, 6, 99])
    assert cached_len == 4
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 99]).page_ids == [pages[0], other[1]]
    assert cache.match_prefix(list(range(8))).page_ids == pages
    cache.check_integrity()


def test_insert_needs_enough_pages() -> None:
    cache, _ = _cache(page_size=2)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [5])


def test_caller_passes_matched_pages_back() -> None:
    """The usual flow: match, lock, compute the suffix, insert matched + new pages, unlock."""
    cache, alloc = _cache(page_size=2)
    _insert(cache, alloc, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    cache.lock(m.last_node)
    new = alloc.alloc(2)  # pages for tokens 4..7 (the last one partial)
    cached_len = cache.insert([1, 2, 3, 4, 5, 6, 7], m.page_ids + new)
    assert cached_len == m.matched_len == 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).page_ids == m.page_ids + new[:1]
    cache.unlock(m.last_node)
    alloc.free(new[1:])  # the partial page stayed with the caller
    assert cache.total_pages == alloc.num_used == 3
    cache.check_integrity()


def test_namespaces_never_share() -> None:
    cache, alloc = _cache()
    a, _ = _insert(cache, alloc, [1, 2, 3], "tenant-a")
    assert cache.match_prefix([1, 2, 3]).matched_len == 0
    assert cache.match_prefix([1, 2, 3], "tenant-b").matched_len == 0
    b, cached_len = _insert(cache, alloc, [1, 2, 3], "tenant-b")
    assert cached_len == 0 and set(a).isdisjoint(b)
    assert cache.match_prefix([1, 2, 3], "tenant-a").page_ids == a
    assert cache.match_prefix([1, 2, 3], "tenant-b").page_ids == b


def test_lock_blocks_eviction_and_counts_shared_pages_once() -> None:
    cache, alloc = _cache()
    _insert(cache, alloc, [1, 2, 3, 4])
    _insert(cache, alloc, [1, 2, 7])
    m1 = cache.match_prefix([1, 2, 3, 4])
    m2 = cache.match_prefix([1, 2, 7])
    cache.lock(m1.last_node)
    cache.lock(m2.last_node)
    assert (cache.locked_pages, cache.evictable_pages) == (5, 0)
    assert cache.evict(10) == 0
    cache.unlock(m1.last_node)
    assert (cache.locked_pages, cache.evictable_pages) == (3, 2)
    assert cache.evict(10) == 2  # only the [3, 4] branch
    assert cache.match_prefix([1, 2, 7]).page_ids == m2.page_ids
    cache.unlock(m2.last_node)
    assert cache.reset() == 3
    assert cache.total_pages == 0 and alloc.num_used == 0
    with pytest.raises(ValueError):
        cache.unlock(m2.last_node)
    with pytest.raises(ValueError):
        cache.lock(m2.last_node)  # evicted


def test_locked_inner_node_survives_losing_its_children() -> None:
    cache, alloc = _cache()
    _insert(cache, alloc, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2])  # splits; last_node is the inner [1, 2] node
    cache.lock(m.last_node)
    assert cache.evict(10) == 2  # [3, 4] goes; [1, 2] is now a locked leaf and stays
    assert cache.match_prefix([1, 2, 3]).page_ids == m.page_ids
    cache.unlock(m.last_node)
    assert cache.reset() == 2 and alloc.num_used == 0


def test_split_keeps_lock_on_holder_path() -> None:
    cache, alloc = _cache()
    _insert(cache, alloc, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.last_node)
    _insert(cache, alloc, [1, 2, 9])  # splits the locked edge after [1, 2]
    assert cache.locked_pages == 4 and cache.evictable_pages == 1
    cache.check_integrity()
    cache.unlock(m.last_node)
    assert cache.locked_pages == 0 and cache.evictable_pages == 5
    cache.check_integrity()


def test_evict_is_lru_and_cascades_to_parents() -> None:
    cache, alloc = _cache()
    _insert(cache, alloc, [1, 2, 3])
    _insert(cache, alloc, [1, 2, 4])
    _insert(cache, alloc, [5, 6])
    cache.match_prefix([1, 2, 3])  # touch: [4] and then [5, 6] are now the oldest leaves
    assert cache.evict(1) == 1  # [4]
    assert cache.match_prefix([1, 2, 4]).matched_len == 2
    assert cache.evict(1) == 2  # [5, 6]: a whole node goes, one page more than asked
    assert cache.match_prefix([5, 6]).matched_len == 0
    assert cache.evict(2) == 3  # [3] then its parent [1, 2], now a leaf
    assert cache.total_pages == 0 and alloc.num_used == 0
    cache.check_integrity()


def test_without_allocator_pages_are_dropped() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [10, 11])
    assert cache.evict(5) == 2 and cache.total_pages == 0


# ---- property test against a reference model ----------------------------------------------

NUM_PAGES = 40
MAX_HELD = 3
# Keys share long prefixes with each other so that matches, splits and shared locks are common.
BASES = [(0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2), (0, 1, 2, 0, 2, 2, 1, 1, 0, 0, 1, 2), (1,) * 12]
keys = st.builds(
    lambda base, cut, tail: list(base[:cut]) + tail,
    st.sampled_from(BASES),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=6),
)
namespaces = st.sampled_from([None, "tenant-a"])

Ref = dict[tuple[str | None, tuple[int, ...]], int]


def _tree_map(cache: RadixCache) -> tuple[Ref, set[int], int, int]:
    """Walk the tree: (page-aligned prefix -> page of its last page, locked pages, recounts)."""
    ps = cache.page_size
    mapping: Ref = {}
    locked: set[int] = set()
    evictable_count = locked_count = 0
    for ns, root in cache._roots.items():
        stack = [(root, ())]
        while stack:
            node, path = stack.pop()
            for i, page in enumerate(node.page_ids):
                mapping[(ns, path + node.key[: (i + 1) * ps])] = page
            if node.lock_ref:
                locked.update(node.page_ids)
                locked_count += len(node.page_ids)
            else:
                evictable_count += len(node.page_ids)
            stack.extend((c, path + node.key) for c in node.children.values())
    return mapping, locked, evictable_count, locked_count


class RadixMachine(RuleBasedStateMachine):
    """Compares RadixCache with ``ref``: every cached page-aligned prefix and its last page."""

    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES)
        self.cache = RadixCache(self.page_size, self.alloc)
        self.ref: Ref = {}
        self.held: list[tuple[MatchResult, list[int], str | None]] = []

    def _ref_match(self, tokens: list[int], ns: str | None) -> list[int]:
        pages = []
        for end in range(self.page_size, len(tokens) + 1, self.page_size):
            page = self.ref.get((ns, tuple(tokens[:end])))
            if page is None:
                break
            pages.append(page)
        return pages

    def _make_room(self, n: int) -> bool:
        if not self.alloc.can_alloc(n):
            self._evict(n - self.alloc.num_free)
        return self.alloc.can_alloc(n)

    def _evict(self, n: int) -> None:
        evictable = self.cache.evictable_pages
        freed = self.cache.evict(n)
        assert min(n, evictable) <= freed <= evictable
        after, _, _, _ = _tree_map(self.cache)
        assert after.items() <= self.ref.items()  # eviction only removes entries
        assert len(self.ref) - len(after) == freed
        self.ref = after

    @rule(tokens=keys, ns=namespaces)
    def insert_fresh(self, tokens: list[int], ns: str | None) -> None:
        n = len(tokens) // self.page_size
        if not self._make_room(n):
            return
        pages = self.alloc.alloc(n)
        expected_len = len(self._ref_match(tokens, ns)) * self.page_size
        cached_len = self.cache.insert(tokens, pages, ns)
        assert cached_len == expected_len
        self.alloc.free(pages[: cached_len // self.page_size])  # duplicates of cached pages
        for i in range(cached_len // self.page_size, n):
            self.ref[(ns, tuple(tokens[: (i + 1) * self.page_size]))] = pages[i]

    @rule(tokens=keys, ns=namespaces)
    def match_lock_insert_unlock(self, tokens: list[int], ns: str | None) -> None:
        m = self.cache.match_prefix(tokens, ns)
        self.cache.lock(m.last_node)
        n = len(tokens) // self.page_size
        have = m.matched_len // self.page_size
        if self._make_room(n - have):  # eviction here must spare the locked prefix
            assert self._ref_match(tokens, ns) == m.page_ids
            new = self.alloc.alloc(n - have)
            cached_len = self.cache.insert(tokens, m.page_ids + new, ns)
            assert cached_len == m.matched_len
            for i in range(have, n):
                self.ref[(ns, tuple(tokens[: (i + 1) * self.page_size]))] = new[i - have]
        self.cache.unlock(m.last_node)

    @rule(tokens=keys, ns=namespaces)
    def match(self, tokens: list[int], ns: str | None) -> None:
        m = self.cache.match_prefix(tokens, ns)
        assert m.page_ids == self._ref_match(tokens, ns)
        assert m.matched_len == len(m.page_ids) * self.page_size

    @precondition(lambda self: len(self.held) < MAX_HELD)
    @rule(tokens=keys, ns=namespaces)
    def match_and_lock(self, tokens: list[int], ns: str | None) -> None:
        m = self.cache.match_prefix(tokens, ns)
        self.cache.lock(m.last_node)
        self.held.append((m, tokens[: m.matched_len], ns))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.held) - 1))
        m, _, _ = self.held.pop(index)
        self.cache.unlock(m.last_node)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        self._evict(n)

    @rule()
    def reset(self) -> None:
        self._evict(self.cache.evictable_pages)
        assert self.cache.evictable_pages == 0

    @invariant()
    def consistent(self) -> None:
        mapping, locked, evictable_count, locked_count = _tree_map(self.cache)
        assert mapping == self.ref
        assert (self.cache.evictable_pages, self.cache.locked_pages) == (
            evictable_count,
            locked_count,
        )
        assert self.cache.total_pages == len(mapping)
        # no page lost or double-owned: the tree and the free list partition the pool
        tree_pages = list(mapping.values())
        assert len(set(tree_pages)) == len(tree_pages)
        assert set(tree_pages).isdisjoint(self.alloc._free)
        assert self.alloc.num_free + len(tree_pages) == NUM_PAGES - 1
        # every held (locked) match is still cached with the same pages, and locked
        for m, tokens, ns in self.held:
            assert self._ref_match(tokens, ns) == m.page_ids
            assert set(m.page_ids) <= locked
        self.cache.check_integrity()


class RadixMachinePage4(RadixMachine):
    page_size = 4


_settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestRadixPage1 = RadixMachine.TestCase
TestRadixPage1.settings = _settings
TestRadixPage4 = RadixMachinePage4.TestCase
TestRadixPage4.settings = _settings
