"""The prefix cache with tiers under the radix tree: L1 the KV pool, L2 host memory, L3 a local
disk, and a store shared by every worker (Mooncake Store). SGLang's HiCache layers the same
tiers; here every block is content-addressed (``block_hash``), so a block means the same KV in
every tier, on every worker, after a restart.

Where a block lives and how it moves (``--kv-cache-write-policy``):

- ``write_through`` (default): a block cached in the pool is copied at once to L2 (a memcpy on
  the engine thread) and queued for L3; eviction from the pool then only drops the pool's copy
  (or copies to L2 a block L2 had let go), eviction from L2 only what L3 already has. A restart
  finds on disk everything that was ever cached.
- ``write_back``: a block goes down one tier when it is evicted from its tier: pool -> L2 ->
  L3 (the pool straight to L3 without L2).
- The shared store is written through under both: a tier that only got evicted blocks would
  not share the hot prefixes that other workers want.

A request's path (the scheduler calls these through ``BasePrefixCache``):

1. :meth:`prefetch` (queued): its prompt's block keys; what the pool has; L2 blocks past that
   are pinned; the rest go to the load thread (``tier_io``), which reads them from L3 or the
   store while other requests compute.
2. :meth:`ready`: the scheduler passes over a request whose load is still running.
3. :meth:`match` (admission): the pool's match, then as many further blocks as L2 or the load
   staged, in chain order, copied into fresh pool pages and cached in the tree.
4. :meth:`admitted`: ``req.cached_by_tier`` says which tier served each cached token.

Failures never serve wrong KV: a block that fails its checksum, a full disk, a store that went
away each end the chain there, are counted (``tier_io.TierCounters``), and the rest of the
prompt is computed. Every move is also a KV event (``stored`` / ``demoted`` / ``removed``) for
the router's cache-aware routing (``server.kv_index``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitserve.engine.kv_pool import KVPool, PageAllocator
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import KVEvent, TierStats
from splitserve.radix_cache.block_hash import KVIdentity, block_keys, chain_root
from splitserve.radix_cache.prefix_cache import RadixPrefixCache
from splitserve.radix_cache.radix_tree import RadixCache, TreeNode
from splitserve.radix_cache.tiers.block_format import BlockFormat, page_rows
from splitserve.radix_cache.tiers.cost_model import LoadCostModel
from splitserve.radix_cache.tiers.disk_tier import DiskTier
from splitserve.radix_cache.tiers.host_tier import HostTier
from splitserve.radix_cache.tiers.store_tier import MooncakeStoreTier
from splitserve.radix_cache.tiers.tier_io import (
    TIERS,
    EventLog,
    LoadJob,
    TierCounters,
    TierIO,
    tier_stats,
)

WRITE_POLICIES = ("write_through", "write_back")
# The adapter part of every block key's chain root. A LoRA adapter's identity (its files'
# digest) is already folded into a request's namespace on the worker (``worker.tasks.new_req``,
# ``radix_cache.namespace``), which the radix tree matches in and every key chains from: blocks
# of different adapters never share a tree node or a key in any tier.
BASE_ADAPTER = ""
MAX_ROOTS = 4096  # chain roots kept (one per namespace seen recently)


@dataclass(slots=True, eq=False)
class _Plan:
    """One queued request's view of the tiers, from :meth:`prefetch` to :meth:`admitted`."""

    keys: list[str]  # block keys of the span a match may cover
    pinned: list[str] = field(default_factory=list)  # L2 keys pinned for it
    job: LoadJob | None = None
    deadline: float = 0.0
    staged: dict[str, tuple[str, str, torch.Tensor]] = field(default_factory=dict)  # key ->
    # (tier, fmt, payload) loaded for it
    origin: dict[str, str] = field(default_factory=dict)  # key -> tier it came into the pool from


class TieredPrefixCache(RadixPrefixCache):
    """The radix cache over the pool (L1) with host memory, disk and a shared store below it.

    Args:
        allocator, page_size: the pool's (as :class:`RadixPrefixCache`).
        pool: the KV pool whose pages are copied down and filled back.
        identity: what besides tokens decides a page's bytes (the root of every key).
        fmt: how pages are stored in the tiers (``--kv-host-cache-dtype``).
        host: L2 (None: none).
        disk: L3 (None: none).
        store: the shared store (None: none).
        write_policy: ``write_through`` or ``write_back`` (module docstring).
        cost: measured rates (default: none measured yet, every load is worth it).
        threaded: run loads and writes on threads (False: inline, for model-free tests).
        load_timeout_s: a load still running after this is given up (the request is matched
            with what is at hand).
        clock: seconds, for the load deadline.

    Raises:
        ValueError: an unknown write policy.
    """

    def __init__(
        self, allocator: PageAllocator, page_size: int, *, pool: KVPool, identity: KVIdentity,
        fmt: BlockFormat, host: HostTier | None = None, disk: DiskTier | None = None,
        store: MooncakeStoreTier | None = None, write_policy: str = "write_through",
        cost: LoadCostModel | None = None, threaded: bool = True, load_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(allocator, page_size)
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy {write_policy!r} is not one of {WRITE_POLICIES}")
        self.tree = RadixCache(page_size, allocator, on_evict=self._on_evict)
        self.pool, self.rows, self.fmt = pool, page_rows(pool), fmt
        self.identity = identity.digest()
        self.host, self.disk, self.store = host, disk, store
        self.store_url = store.url if store is not None else ""
        self.write_through = write_policy == "write_through"
        self.cost = cost or LoadCostModel(bytes_per_token=fmt.sizes["raw"] / page_size)
        self.counters = {t: TierCounters() for t in TIERS}
        self.events = EventLog()
        self.io = TierIO(disk, store, self.cost, self.counters, self.events, threaded=threaded)
        self.load_timeout_s = load_timeout_s
        self.clock = clock
        self._plans: dict[int, _Plan] = {}
        self._roots: dict[str | None, bytes] = {}
        self._flushing = False

    # ---- keys ---------------------------------------------------------------------------------

    def keys_of(self, tokens: list[int], namespace: str | None) -> list[str]:
        """Block keys of the whole pages of ``tokens`` in ``namespace`` (``block_hash``)."""
        root = self._roots.get(namespace)
        if root is None:
            if len(self._roots) >= MAX_ROOTS:
                self._roots.clear()
            root = chain_root(self.identity, namespace, BASE_ADAPTER)
            self._roots[namespace] = root
        return block_keys(root, tokens, self.page_size)

    # ---- a request's way in -------------------------------------------------------------------

    def prefetch(self, req: Req) -> None:
        if req.uid in self._plans or req.output_ids:
            return  # a retracted request matches what is at hand
        tokens = req.tokens(0, self.match_end(req))
        if len(tokens) < self.page_size:
            return
        ns = req.cache_namespace
        plan = _Plan(self.keys_of(tokens, ns))
        start = self.tree.match_prefix(tokens, ns).matched_len // self.page_size
        rest = plan.keys[start:]
        if self.host is not None:
            for key in rest:
                if key in self.host:
                    self.host.pin(key)
                    plan.pinned.append(key)
        if len(plan.pinned) < len(rest) and (self.disk is not None or self.store is not None):
            plan.job = LoadJob(req.uid, rest, frozenset(plan.pinned))
            plan.deadline = self.clock() + self.load_timeout_s
        self._plans[req.uid] = plan
        if plan.job is not None:
            self.io.load(plan.job)

    def ready(self, req: Req) -> bool:
        self._collect()
        plan = self._plans.get(req.uid)
        if plan is None or plan.job is None or plan.job.done:
            return True
        if self.clock() >= plan.deadline:
            plan.job.cancelled = True  # what it loads later is dropped
            plan.job = None
            return True
        return False

    @property
    def is_loading(self) -> bool:
        return self.io.loading

    def match(self, req: Req) -> None:
        super().match(req)
        self._collect()
        tokens = req.tokens(0, self.match_end(req))
        if len(tokens) < self.page_size:
            return
        ns = req.cache_namespace
        plan = self._plans.get(req.uid)
        if plan is None:
            plan = self._plans[req.uid] = _Plan(self.keys_of(tokens, ns))
        ps, first = self.page_size, req.matched_len // self.page_size
        take = self._loadable(plan, first)
        if not take:
            return
        l2_keys = [k for k, src in take if src == "l2"]
        for key in l2_keys:  # evictions that make room demote into L2: keep these there
            self.host.pin(key)  # type: ignore[union-attr]
        try:
            self.ensure_free(len(take))
            take = take[: self.allocator.num_free]
            pages = self.allocator.alloc(len(take))
            self._fill(pages, take, plan)
        finally:
            for key in l2_keys:
                self.host.unpin(key)  # type: ignore[union-attr]
        if not take:
            return
        new_len = (first + len(take)) * ps
        cached = self._insert_blocks(req.tokens(0, new_len), req.page_ids + pages, ns,
                                     plan.origin)
        assert cached == req.matched_len, "a match is the longest cached prefix"
        result = self.tree.match_prefix(req.tokens(0, new_len), ns)
        self.tree.lock(result.last_node)
        if req.locked_node is not None:
            self.tree.unlock(req.locked_node)  # type: ignore[arg-type]
        req.locked_node, req.page_ids = result.last_node, list(result.page_ids)
        req.kv_len = req.matched_len = result.matched_len

    def admitted(self, req: Req) -> None:
        first = not req.output_ids
        super().admitted(req)
        plan = self._plans.pop(req.uid, None)
        if first:
            by_tier: dict[str, int] = {}
            keys = plan.keys if plan is not None else []
            for i in range(req.cached_len // self.page_size):
                tier = plan.origin.get(keys[i], "l1") if plan is not None else "l1"
                by_tier[tier] = by_tier.get(tier, 0) + self.page_size
            req.cached_by_tier = by_tier
            for tier, n in by_tier.items():
                self.counters[tier].hit_tokens += n
        self._drop(plan)

    def release(self, req: Req) -> None:
        super().release(req)
        self._drop(self._plans.pop(req.uid, None))

    # ---- inserts and evictions ----------------------------------------------------------------

    def insert(self, tokens: list[int], page_ids: list[int], namespace: str | None) -> int:
        return self._insert_blocks(tokens, page_ids, namespace, None)

    def flush(self) -> int:
        """Drop every unpinned block of every tier this worker owns (the pool, L2, L3); the
        shared store keeps its blocks."""
        self._flushing = True
        try:
            freed = self.tree.reset()
        finally:
            self._flushing = False
        self.evicted_pages += freed
        if self.host is not None:
            self.events.add("removed", "l2", self.host.clear())
        self.io.drain_writes()
        if self.disk is not None:
            self.events.add("removed", "l3", self.disk.clear())
        return freed

    def _insert_blocks(self, tokens: list[int], page_ids: list[int], ns: str | None,
                       origin: dict[str, str] | None) -> int:
        cached = self.tree.insert(tokens, page_ids, ns)
        ps = self.page_size
        n, c = len(tokens) // ps, cached // ps
        if n > c:
            keys = self.keys_of(tokens[: n * ps], ns)[c:n]
            self._on_new_blocks(keys, list(page_ids[c:n]), origin or {})
        return cached

    def _on_new_blocks(self, keys: list[str], pages: list[int], origin: dict[str, str]) -> None:
        """Blocks just cached in the pool: events, and copies down the tiers that take them
        now (L2 and L3 when writing through; the store always)."""
        self.events.add("stored", "l1", keys)
        host, disk = self.host, self.disk
        to_host = [i for i, k in enumerate(keys)
                   if self.write_through and host is not None and k not in host]
        targets = []
        for i, k in enumerate(keys):
            t = tuple(name for name, on in (
                ("l3", self.write_through and disk is not None and not disk.contains(k)),
                ("store", self.store is not None and origin.get(k) != "store")) if on)
            targets.append(t)
        if not to_host and not any(targets):
            return
        rows = self._copy_rows(pages)
        if to_host:
            fit = to_host[: self._host_room(len(to_host))]
            if fit:
                sel = torch.tensor(fit, dtype=torch.long)
                host.store([keys[i] for i in fit], "raw", rows[sel])  # type: ignore[union-attr]
                self.events.add("stored", "l2", [keys[i] for i in fit])
        for i, t in enumerate(targets):
            if t:
                self.io.write(keys[i], "raw", rows[i], t)

    def _on_evict(self, node: TreeNode) -> None:
        """The tree evicts ``node`` (its pages are freed next): copy what the tiers keep."""
        ns, tokens = self.tree.path_of(node)
        keys = self.keys_of(tokens, ns)[-len(node.page_ids):]
        if self._flushing or (self.host is None and self.disk is None):
            self.events.add("removed", "l1", keys)
            return
        host = self.host
        if host is None:
            down = [] if self.write_through else [
                i for i, k in enumerate(keys) if not self.disk.contains(k)]  # type: ignore[union-attr]
            if down:
                rows = self._copy_rows([node.page_ids[i] for i in down])
                for j, i in enumerate(down):
                    self.io.write(keys[i], "raw", rows[j], ("l3",))
            self.events.add("removed", "l1", keys)
            return
        new = [i for i, k in enumerate(keys) if k not in host]
        self.events.add("removed", "l1", [k for k in keys if k in host])
        if not new:
            return
        fit = new[: self._host_room(len(new))]
        if fit:
            rows = self._copy_rows([node.page_ids[i] for i in fit])
            host.store([keys[i] for i in fit], "raw", rows)
            self.events.add("demoted", "l2", [keys[i] for i in fit], "l1")
        lost = new[len(fit):]
        if lost and self.disk is not None and not self.write_through:
            rows = self._copy_rows([node.page_ids[i] for i in lost])
            for j, i in enumerate(lost):
                self.io.write(keys[i], "raw", rows[j], ("l3",))
        self.events.add("removed", "l1", [keys[i] for i in lost])

    def _host_room(self, n: int) -> int:
        """Make room for ``n`` blocks in L2, demoting its least recently used unpinned blocks
        to L3 (those L3 does not have yet); returns how many fit now."""
        host = self.host
        assert host is not None
        victims = host.victims(n)
        if victims:
            if self.disk is not None:
                down = [k for k in victims if not self.disk.contains(k)]
                if down:
                    payloads = host.payloads(down)
                    for j, key in enumerate(down):
                        self.io.write(key, host.fmt.fmt, payloads[j], ("l3",))
            host.evict(len(victims))
            self.events.add("removed", "l2", victims)
        return min(n, host.num_free)

    # ---- copies -------------------------------------------------------------------------------

    def _copy_rows(self, pages: list[int]) -> torch.Tensor:
        """Copies of pool pages ``pages``, ``uint8 [n, page_bytes]`` on the CPU."""
        idx = torch.tensor(pages, dtype=torch.long, device=self.rows.device)
        return self.rows.index_select(0, idx).cpu()

    def _loadable(self, plan: _Plan, first: int) -> list[tuple[str, str]]:
        """``(key, source)`` of the blocks past ``first`` that L2 (``l2``) or this request's
        load (``staged``) has, in chain order, up to the first neither has."""
        take = []
        for key in plan.keys[first:]:
            if self.host is not None and key in self.host:
                if not self.cost.worth_loading("l2"):
                    break
                take.append((key, "l2"))
            elif key in plan.staged:
                take.append((key, "staged"))
            else:
                break
        return take

    def _fill(self, pages: list[int], take: list[tuple[str, str]], plan: _Plan) -> None:
        """Copy the blocks of ``take`` into pool ``pages`` and record where each came from."""
        device = self.rows.device
        l2 = [i for i, (_, src) in enumerate(take) if src == "l2"]
        if l2:
            t0 = time.perf_counter()
            rows = self.host.read([take[i][0] for i in l2])  # type: ignore[union-attr]
            idx = torch.tensor([pages[i] for i in l2], dtype=torch.long, device=device)
            self.rows.index_copy_(0, idx, rows.to(device))
            dt = time.perf_counter() - t0
            nbytes = rows.numel()
            self.cost.observe_load("l2", nbytes, dt)
            c = self.counters["l2"]
            c.load_blocks += len(l2)
            c.load_bytes += nbytes
            c.load_s += dt
        for i, (key, src) in enumerate(take):
            if src == "staged":
                tier, fmt, payload = plan.staged.pop(key)
                self.rows[pages[i]] = self.fmt.decode(fmt, payload.view(1, -1))[0].to(device)
                plan.origin.setdefault(key, tier)
            else:
                plan.origin.setdefault(key, "l2")

    def _collect(self) -> None:
        """Move the blocks of finished loads to their requests' plans."""
        for job in self.io.finished():
            plan = self._plans.get(job.uid)
            if plan is None or plan.job is not job:
                continue  # released, or given up on
            for key, tier, fmt, payload in job.blocks:
                plan.staged[key] = (tier, fmt, payload)

    def _drop(self, plan: _Plan | None) -> None:
        if plan is None:
            return
        for key in plan.pinned:
            self.host.unpin(key)  # type: ignore[union-attr]
        plan.pinned.clear()
        if plan.job is not None:
            plan.job.cancelled = True
        plan.staged.clear()

    # ---- the rest of the seam -----------------------------------------------------------------

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe_prefill(num_tokens, seconds)

    def prefill_rate(self) -> float:
        return self.cost.prefill.value or 0.0

    def drain_events(self) -> list[KVEvent]:
        return self.events.drain()

    def snapshot_events(self) -> list[KVEvent]:
        snap = EventLog()
        snap.add("stored", "l1", self._l1_keys())
        if self.host is not None:
            snap.add("stored", "l2", self.host.keys())
        if self.disk is not None:
            snap.add("stored", "l3", self.disk.keys())
        return snap.drain()

    def _l1_keys(self) -> list[str]:
        """Keys of every block in the pool's tree (chained along each path)."""
        last: dict[int, bytes] = {}
        keys: list[str] = []
        for ns, parent, node in self.tree.walk():
            prev = last.get(id(parent))
            if prev is None:
                prev = chain_root(self.identity, ns, BASE_ADAPTER)
            node_keys = block_keys(prev, node.key, self.page_size)
            last[id(node)] = bytes.fromhex(node_keys[-1])
            keys += node_keys
        return keys

    def tier_stats(self) -> list[TierStats]:
        page_bytes = self.rows.shape[1]
        rows = [tier_stats("l1", self.counters["l1"], self.rows.numel(),
                           self.tree.total_pages * page_bytes, self.tree.total_pages, self.cost)]
        if self.host is not None:
            rows.append(tier_stats("l2", self.counters["l2"], self.host.capacity_bytes,
                                   self.host.used_bytes, self.host.num_blocks, self.cost))
        if self.disk is not None:
            rows.append(tier_stats("l3", self.counters["l3"], self.disk.capacity_bytes,
                                   self.disk.used_bytes, self.disk.num_blocks, self.cost))
        if self.store is not None:
            rows.append(tier_stats("store", self.counters["store"], self.store.segment_bytes,
                                   0, 0, self.cost))
        return rows

    def check_integrity(self) -> None:
        """The tree's and L2's own checks (tests, idle-time checks).

        Raises:
            AssertionError: an inconsistency.
        """
        self.tree.check_integrity()
        if self.host is not None:
            self.host.check_integrity()

    def close(self) -> None:
        self.io.close()
        if self.store is not None:
            self.store.close()
