"""The router's index of which KV blocks each worker's cache tiers hold, fed by the workers' KV
events (``ipc.messages.KVEvents``; Dynamo's KV router and vLLM's KV events work this way).

Each prefill or colocated worker publishes, after every loop iteration, the blocks it stored in
a tier, demoted from one tier to the next, or removed (``radix_cache.tiered_cache``), and a full
snapshot when it starts or when a router asks (:class:`~splitserve.ipc.messages.KVEventsQuery`:
a router that joined late, or saw a gap in the worker's ``seq``). The router computes the same
content addresses from a prompt (``radix_cache.block_hash``: the worker's ``identity`` and page
size come with its events; the namespace is the request's), so it knows how long a prefix each
worker holds, in which tier, including its host memory and disk, and the blocks of a store that
workers share count for every worker that reads it. Several routers over one pool each get
every worker's events, so they agree on where a prefix is (their loads, each its own requests,
still differ).

A stale entry costs nothing but a worse placement: the worker matches its own tiers again, and
recomputes what is gone. Store blocks are never reported removed (the store's master evicts on
its own): they are kept up to ``MAX_STORE_KEYS``, least recently stored dropped first. No torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from splitserve.ipc.messages import KVEvents
from splitserve.radix_cache.block_hash import block_keys, chain_root

MAX_STORE_KEYS = 1 << 20
FAST_TIERS = frozenset(("l1", "l2"))  # already in the worker's memory


@dataclass(slots=True)
class WorkerBlocks:
    """What one worker holds: block key -> the tiers holding it."""

    identity: str
    page_size: int
    store: str = ""
    seq: int = -1
    tiers: dict[str, set[str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class IndexMatch:
    """How much of a prompt a worker's tiers hold: ``tokens`` in all (a leading run of whole
    blocks), ``fast_tokens`` of them in its pool or host memory."""

    tokens: int = 0
    fast_tokens: int = 0


class KVEventIndex:
    """Per worker (by inbox address), the blocks its tiers hold; per store, the blocks it holds."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerBlocks] = {}
        self.stores: dict[str, OrderedDict[str, None]] = {}
        self._roots: dict[tuple[str, str | None], bytes] = {}

    def apply(self, msg: KVEvents) -> bool:
        """Take a worker's events. Returns False when a snapshot is needed: the events do not
        follow the last ones seen (a router that joined late, a lost message)."""
        w = self.workers.get(msg.addr)
        if w is None or msg.snapshot or w.identity != msg.identity:
            w = self.workers[msg.addr] = WorkerBlocks(msg.identity, msg.page_size, msg.store)
        in_order = msg.snapshot or msg.seq == w.seq + 1
        w.seq = msg.seq
        for ev in msg.events:
            if ev.tier == "store":
                self._store_event(msg.store, ev.kind, ev.keys)
                continue
            for key in ev.keys:
                if ev.kind == "removed" or ev.kind == "demoted":
                    held = w.tiers.get(key)
                    if held is not None:
                        held.discard(ev.from_tier if ev.kind == "demoted" else ev.tier)
                        if not held:
                            del w.tiers[key]
                if ev.kind != "removed":
                    w.tiers.setdefault(key, set()).add(ev.tier)
        return in_order

    def _store_event(self, store: str, kind: str, keys: list[str]) -> None:
        if not store:
            return
        held = self.stores.setdefault(store, OrderedDict())
        for key in keys:
            if kind == "removed":
                held.pop(key, None)
            else:
                held[key] = None
                held.move_to_end(key)
        while len(held) > MAX_STORE_KEYS:
            held.popitem(last=False)

    def forget(self, addr: str) -> None:
        """The worker at ``addr`` is gone: its tiers (but not a shared store) with it."""
        self.workers.pop(addr, None)

    def knows(self, addr: str) -> bool:
        return addr in self.workers

    def match(self, addr: str, input_ids: Sequence[int], namespace: str | None) -> IndexMatch:
        """How much of a prompt the worker at ``addr`` holds (what its match may cover: all
        but the prompt's last token)."""
        w = self.workers.get(addr)
        if w is None:
            return IndexMatch()
        root_key = (w.identity, namespace)
        root = self._roots.get(root_key)
        if root is None:
            if len(self._roots) > 4096:
                self._roots.clear()
            root = self._roots[root_key] = chain_root(w.identity, namespace)
        store = self.stores.get(w.store) if w.store else None
        tokens = fast = 0
        for key in block_keys(root, input_ids[: len(input_ids) - 1], w.page_size):
            held = w.tiers.get(key)
            if held:
                tokens += w.page_size
                if held & FAST_TIERS:
                    fast += w.page_size
            elif store is not None and key in store:
                tokens += w.page_size
            else:
                break
        return IndexMatch(tokens, fast)
