"""Routing policies: which prefill (or colocated) worker gets a request.

``cache_aware`` (default) sends a request to the worker whose cache holds the longest prefix of
its prompt, unless the load is unbalanced, in which case the least-loaded worker gets it (as
SGLang's router does). What a worker holds it learns two ways: the workers' KV events
(``server.kv_index``: every block in every tier of the worker, host memory and disk included, and
a shared store's blocks for every worker that reads it; what other routers sent there too), and,
for what is still being computed, an approximate radix tree of the prompts this router sent
(assumed held up to a bounded size). The longer of the two counts; among equal lengths a worker
that has more of it in memory (pool or host tier) wins. ``round_robin`` cycles, ignoring
prefixes: the baseline to compare against.
Units: tokens; load is requests in flight.

Tenants: a request matches only prompts sent in its own prefix-cache namespace
(``server.tenancy.cache_namespace``), as the workers' radix caches do. Routing by another
tenant's prefix would send a request where it cannot hit, and its placement (hence its
latency) would depend on what another tenant sent: the side channel the namespaces close.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from splitserve.config.registry import ROUTING
from splitserve.ipc.messages import KVEvents
from splitserve.radix_cache.radix_tree import RadixCache
from splitserve.server.kv_index import KVEventIndex


class RoutedWorker(Protocol):
    """What a policy reads from a worker handle."""

    addr: str
    in_flight: int


class BaseRoutingPolicy(abc.ABC):
    """Chooses among live workers of one role."""

    @abc.abstractmethod
    def pick(
        self, workers: Sequence[RoutedWorker], input_ids: Sequence[int],
        namespace: str | None = None,
    ) -> RoutedWorker:
        """The worker for a request with prompt ``input_ids`` in prefix-cache ``namespace``
        (None: the shared one); ``workers`` is non-empty."""

    def flush(self) -> None:
        """Workers dropped their caches (``POST /flush_cache``): forget what they hold."""

    def observe(self, msg: KVEvents) -> bool:
        """A worker's KV events; False when the policy needs a snapshot from it (a gap)."""
        return True

    def forget(self, addr: str) -> None:
        """The worker at ``addr`` died: what it held is gone."""


class RoundRobinPolicy(BaseRoutingPolicy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(
        self, workers: Sequence[RoutedWorker], input_ids: Sequence[int],
        namespace: str | None = None,
    ) -> RoutedWorker:
        return workers[next(self._counter) % len(workers)]


@dataclass(slots=True)
class CacheAwareConfig:
    """Thresholds, as SGLang's router names them.

    The load counts as unbalanced when ``max - min > balance_abs_threshold`` requests and
    ``max > balance_rel_threshold * min``; then the least-loaded worker wins. Otherwise the
    longest match wins if it covers at least ``cache_threshold`` of the prompt; below that the
    least-loaded worker (ties: the smallest tree) gets it, to spread new prefixes.
    ``max_tree_tokens`` bounds each worker's tree, all namespaces together (LRU eviction),
    like a worker's pool does.
    """

    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.3
    max_tree_tokens: int = 1 << 20


class CacheAwarePolicy(BaseRoutingPolicy):
    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self._trees: dict[str, RadixCache] = {}
        self.index = KVEventIndex()

    def _tree(self, addr: str) -> RadixCache:
        if addr not in self._trees:
            # page_size 1 and no allocator: it tracks token prefixes, it owns no memory.
            self._trees[addr] = RadixCache(page_size=1, allocator=None)
        return self._trees[addr]

    def pick(
        self, workers: Sequence[RoutedWorker], input_ids: Sequence[int],
        namespace: str | None = None,
    ) -> RoutedWorker:
        cfg = self.config
        loads = [w.in_flight for w in workers]
        lo, hi = min(loads), max(loads)
        least_loaded = min(workers, key=lambda w: (w.in_flight, self._tree(w.addr).total_pages))
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            chosen = least_loaded
        else:
            sent = [self._tree(w.addr).match_prefix(input_ids, namespace).matched_len
                    for w in workers]
            held = [self.index.match(w.addr, input_ids, namespace) for w in workers]
            matched = [max(s, h.tokens) for s, h in zip(sent, held)]
            best = max(range(len(workers)),
                       key=lambda i: (matched[i], held[i].fast_tokens, -loads[i]))
            covers = matched[best] >= cfg.cache_threshold * len(input_ids)
            chosen = workers[best] if matched[best] and covers else least_loaded
        self._remember(chosen.addr, input_ids, namespace)
        return chosen

    def _remember(
        self, addr: str, input_ids: Sequence[int], namespace: str | None = None,
    ) -> None:
        tree = self._tree(addr)
        # Page ids are unused without an allocator.
        tree.insert(input_ids, [0] * len(input_ids), namespace)
        over = tree.total_pages - self.config.max_tree_tokens
        if over > 0:
            tree.evict(over)

    def flush(self) -> None:
        self._trees.clear()

    def observe(self, msg: KVEvents) -> bool:
        return self.index.apply(msg)

    def forget(self, addr: str) -> None:
        self._trees.pop(addr, None)
        self.index.forget(addr)


def create_routing_policy(name: str) -> BaseRoutingPolicy:
    """The policy called ``name`` (``splitserve.config.registry.ROUTING``).

    Raises:
        ValueError: unknown name.
    """
    return ROUTING.load(name)()
