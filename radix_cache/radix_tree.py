"""Radix prefix cache: a tree over token ids whose nodes own the KV page ids of their tokens.

Units: lengths are in tokens, ``*_pages`` counts are in pages of ``page_size`` tokens. Every edge
holds a whole number of pages, so with ``page_size > 1`` only whole pages are ever matched or
cached; a prompt's partial last page stays with its request.

Each namespace (tenant salt, LoRA id; None is the default) has its own sub-root, so two namespaces
never share an entry even for identical tokens.

Ownership: a page is owned by exactly one node. ``lock`` pins a node and all its ancestors (the
pages a running request reads); ``evict`` frees least-recently-used unlocked leaves into the
allocator. A parent cannot be evicted before its children, so every cached prefix stays whole.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: the API server's router builds trees with no allocator, no torch
    from splitserve.engine.kv_pool import PageAllocator

Namespace = str | None


class TreeNode:
    """One edge of the tree and the node it leads to.

    Attributes:
        key: the edge's tokens, ``len(key) == len(page_ids) * page_size``.
        page_ids: KV pages of those tokens, owned by this node.
        children: child nodes keyed by the tokens of their first page.
        parent: None for a namespace root.
        lock_ref: running requests that pin this node (directly or through a descendant).
        last_access: logical clock of the last match or insert that touched this node.
        is_evicted: the node was removed from the tree; locking it is an error.
    """

    __slots__ = ("children", "is_evicted", "key", "last_access", "lock_ref", "page_ids", "parent")

    def __init__(self, key: tuple[int, ...], page_ids: list[int], parent: TreeNode | None) -> None:
        self.key = key
        self.page_ids = page_ids
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.is_evicted = False

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Longest cached prefix of a key.

    Attributes:
        page_ids: pages of the matched prefix, in order (owned by the tree: do not free them).
        matched_len: matched tokens, a multiple of ``page_size``.
        last_node: node ending exactly at the match; pass it to ``lock``/``unlock``.
    """

    page_ids: list[int]
    matched_len: int
    last_node: TreeNode


class RadixCache:
    """Prefix cache over token ids with page-aligned entries, LRU eviction and locking.

    Args:
        page_size: tokens per KV page (>= 1).
        allocator: where evicted pages go; None only drops them from the tree (a cache that
            tracks prefixes without owning memory, e.g. a router's estimate of a worker's cache).
        on_evict: called with each node :meth:`evict` removes, before its pages are freed (its
            path is still readable with :meth:`path_of`): where tiers below the pool copy the
            pages they keep (``radix_cache.tiered_cache``). It must not change the tree.
    """

    def __init__(self, page_size: int, allocator: PageAllocator | None = None,
                 on_evict: Callable[[TreeNode], None] | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.on_evict = on_evict
        self._roots: dict[Namespace, TreeNode] = {}
        self._empty_root = TreeNode((), [], None)  # last_node of a miss in an unknown namespace
        self._clock = itertools.count(1)
        self.evictable_pages = 0
        """Pages in unlocked nodes (can be freed by :meth:`evict`)."""
        self.locked_pages = 0
        """Pages in locked nodes; a page shared by several requests counts once."""

    @property
    def total_pages(self) -> int:
        """Pages owned by the tree."""
        return self.evictable_pages + self.locked_pages

    # ---- lookup ----------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], namespace: Namespace = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``tokens`` in ``namespace``.

        Splits an edge when the match ends inside it, so ``last_node`` covers exactly the match.
        Marks the matched path as recently used.
        """
        root = self._roots.get(namespace)
        if root is None:
            return MatchResult([], 0, self._empty_root)
        node, matched_len, page_ids = self._walk(root, self._page_aligned(tokens))
        return MatchResult(page_ids, matched_len, node)

    def insert(
        self, tokens: Sequence[int], page_ids: Sequence[int], namespace: Namespace = None
    ) -> int:
        """Cache ``tokens`` with their KV pages; returns the length already cached (tokens).

        ``tokens`` is cut to whole pages: ``n = len(tokens) // page_size`` pages are considered
        and ``page_ids[i]`` holds tokens ``[i * page_size, (i + 1) * page_size)``.
        With ``c = returned_len // page_size``:

        - ``page_ids[c:n]`` now belong to the tree (the caller must not free them);
        - ``page_ids[:c]`` are not taken: the tree keeps its own pages for that span. Those the
          caller got from :meth:`match_prefix` are the tree's and must not be freed; the rest are
          duplicates the caller frees (typically ``page_ids[matched_len // page_size:c]``);
        - ``page_ids[n:]`` (a partial last page) stay with the caller.

        Raises:
            ValueError: fewer than ``n`` page ids.
        """
        key = self._page_aligned(tokens)
        num_pages = len(key) // self.page_size
        if len(page_ids) < num_pages:
            raise ValueError(f"{len(key)} tokens need {num_pages} pages, got {len(page_ids)}")
        if not key:
            return 0
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode((), [], None)
        node, cached_len, _ = self._walk(root, key)
        if cached_len < len(key):
            leaf = TreeNode(
                key[cached_len:], list(page_ids[cached_len // self.page_size : num_pages]), node
            )
            leaf.last_access = next(self._clock)
            node.children[self._child_key(leaf.key)] = leaf
            self.evictable_pages += len(leaf.page_ids)  # a new leaf has no lockers
        return cached_len

    # ---- locking ---------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors: their pages are not evicted until :meth:`unlock`."""
        if node.is_evicted:
            raise ValueError("cannot lock an evicted node (lock right after match_prefix)")
        while not node.is_root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.page_ids)
                self.locked_pages += len(node.page_ids)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        """Undo one :meth:`lock` of ``node``.

        Raises:
            ValueError: ``node`` is not locked.
        """
        if not node.is_root and node.lock_ref <= 0:
            raise ValueError("unlock of a node that is not locked")
        while not node.is_root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_pages -= len(node.page_ids)
                self.evictable_pages += len(node.page_ids)
            node = node.parent  # type: ignore[assignment]

    # ---- eviction --------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages if that many are evictable; returns pages freed.

        Frees whole nodes, least recently used unlocked leaf first, so it may free a few more
        pages than asked. A parent whose last child goes becomes a candidate in turn.
        """
        heap = [
            (n.last_access, id(n), n) for n in self._nodes() if not n.children and not n.lock_ref
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None  # roots own no pages and are never pushed
            del parent.children[self._child_key(node.key)]
            node.is_evicted = True
            freed += len(node.page_ids)
            self.evictable_pages -= len(node.page_ids)
            if self.on_evict is not None:
                self.on_evict(node)
            if self.allocator is not None:
                self.allocator.free(node.page_ids)
            if parent.is_root:
                if not parent.children:  # forget empty namespaces so tenants do not pile up
                    self._roots = {ns: r for ns, r in self._roots.items() if r is not parent}
            elif not parent.children and not parent.lock_ref:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> int:
        """Free every unlocked page; returns pages freed. Locked paths stay cached."""
        return self.evict(self.evictable_pages)

    # ---- paths -----------------------------------------------------------------------------

    def path_of(self, node: TreeNode) -> tuple[Namespace, list[int]]:
        """The namespace and the tokens from its root to the end of ``node``'s edge (also for a
        node :meth:`evict` is removing, while ``on_evict`` runs)."""
        edges = []
        while node.parent is not None:
            edges.append(node.key)
            node = node.parent
        namespace = next((ns for ns, r in self._roots.items() if r is node), None)
        return namespace, [t for edge in reversed(edges) for t in edge]

    def walk(self) -> Iterator[tuple[Namespace, TreeNode, TreeNode]]:
        """``(namespace, parent, node)`` for every non-root node, parents first."""
        for ns, root in self._roots.items():
            stack = [(root, c) for c in root.children.values()]
            while stack:
                parent, node = stack.pop()
                yield ns, parent, node
                stack.extend((node, c) for c in node.children.values())

    # ---- internals -------------------------------------------------------------------------

    def _page_aligned(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[: len(tokens) // self.page_size * self.page_size])

    def _child_key(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return key[: self.page_size]

    def _walk(self, root: TreeNode, key: tuple[int, ...]) -> tuple[TreeNode, int, list[int]]:
        """Follow ``key`` from ``root``; returns (deepest node, matched tokens, their pages).

        Splits the last edge at the page where ``key`` diverges, and stamps the path as used.
        """
        now = next(self._clock)
        node, pos, page_ids = root, 0, []
        node.last_access = now
        while pos < len(key):
            child = node.children.get(self._child_key(key[pos:]))
            if child is None:
                break
            common = self._common_len(child.key, key, pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            page_ids.extend(child.page_ids)
            # After a split no child of ``child`` starts with key's next page, so the loop ends.
            node, pos = child, pos + common
        return node, pos, page_ids

    def _common_len(self, edge: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
        """Tokens shared by ``edge`` and ``key[start:]``, rounded down to whole pages."""
        limit = min(len(edge), len(key) - start)
        i = 0
        while i < limit and edge[i] == key[start + i]:
            i += 1
        return i // self.page_size * self.page_size

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child``'s edge after ``at`` tokens (a page boundary, > 0); returns the new upper
        node. ``child`` keeps its identity as the lower part, so a lock holder's node still ends
        where it did; the upper part inherits its lock count and access time."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        cut = at // self.page_size
        upper = TreeNode(child.key[:at], child.page_ids[:cut], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[self._child_key(upper.key)] = upper
        child.key, child.page_ids, child.parent = child.key[at:], child.page_ids[cut:], upper
        upper.children[self._child_key(child.key)] = child
        return upper

    def _nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Recount pages and locks by walking the tree (for tests and idle-time checks).

        Raises:
            AssertionError: a counter, lock count or page id is inconsistent.
        """
        evictable = locked = 0
        seen: set[int] = set()
        for node in self._nodes():
            assert len(node.key) == len(node.page_ids) * self.page_size > 0
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values())
            assert seen.isdisjoint(node.page_ids), "a page is owned by two nodes"
            seen.update(node.page_ids)
            if node.lock_ref:
                locked += len(node.page_ids)
            else:
                evictable += len(node.page_ids)
        assert (evictable, locked) == (self.evictable_pages, self.locked_pages)
