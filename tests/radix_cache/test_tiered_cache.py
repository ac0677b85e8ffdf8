"""The tiered prefix cache with no model: demotion, promotion and matching across the pool (L1),
host memory (L2) and disk (L3), checked against a reference cache of unbounded size; failures
of the disk; tenants. Every page a match lends is checked to hold its own block's K/V."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from splitserve.engine.sched.request import Req
from splitserve.radix_cache.namespace import adapter_namespace
from splitserve.radix_cache.tiers.cost_model import LoadCostModel
from tests.radix_cache.tiered_fixtures import (
    LAYOUT,
    admit,
    compute,
    make_cache,
    matched_content_ok,
    new_req,
)


def _serve(cache, tokens: list[int], ns: str | None = None) -> Req:
    """One request through admission, 'prefill' and release; returns it (as admitted)."""
    req = new_req(tokens, ns)
    admit(cache, req)
    assert matched_content_ok(cache, req)
    compute(cache, req)
    seen = Req(req.rid, req.input_ids, req.sampling, cached_len=req.cached_len,
               matched_len=req.matched_len)
    seen.cached_by_tier = dict(req.cached_by_tier)
    cache.release(req)
    return seen


def _churn(cache, n: int = 6) -> None:
    for s in range(n):
        _serve(cache, [1000 + s] * 8)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_an_evicted_prefix_comes_back_from_each_tier(tmp_path: Path, policy: str) -> None:
    cache = make_cache(tmp_path, num_pages=8, host_slots=4, disk_bytes=1 << 20, policy=policy)
    prompt = list(range(10))  # 5 blocks of 2
    assert _serve(cache, prompt).cached_len == 0
    again = _serve(cache, prompt)
    assert again.cached_by_tier == {"l1": 10}
    cache.evict(cache.tree.evictable_pages)  # all of it leaves the pool: 4 fit in L2
    from_l2 = _serve(cache, prompt)
    assert from_l2.cached_len == 10 and from_l2.cached_by_tier.get("l2", 0) >= 8
    _churn(cache)  # L1 and L2 now hold other prompts only
    from_l3 = _serve(cache, prompt)
    assert from_l3.cached_by_tier == {"l3": 10}
    cache.check_integrity()


def test_counts_and_events_follow_the_blocks(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, num_pages=8, host_slots=4, disk_bytes=1 << 20,
                       policy="write_back")
    _serve(cache, list(range(10)))
    events = cache.drain_events()
    assert [(e.kind, e.tier, len(e.keys)) for e in events] == [("stored", "l1", 5)]
    cache.evict(5)
    events = cache.drain_events()
    kinds = {(e.kind, e.tier, e.from_tier) for e in events}
    assert ("demoted", "l2", "l1") in kinds and ("stored", "l3", "") in kinds
    stats = {s.tier: s for s in cache.tier_stats()}
    assert stats["l2"].blocks == 4 and stats["l3"].blocks == 1 and stats["l1"].blocks == 0


def test_tenants_never_share_in_any_tier(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, num_pages=8, host_slots=4, disk_bytes=1 << 20)
    prompt = list(range(10))
    _serve(cache, prompt, "tenant-a")
    cache.evict(cache.tree.evictable_pages)
    _churn(cache)
    assert _serve(cache, prompt, "tenant-b").cached_len == 0
    assert _serve(cache, prompt, None).cached_len == 0
    assert _serve(cache, prompt, "tenant-a").cached_len == 10


def test_a_restart_with_the_same_disk_serves_old_prefixes(tmp_path: Path) -> None:
    first = make_cache(tmp_path, host_slots=4, disk_bytes=1 << 20)
    _serve(first, list(range(12)))
    first.close()
    again = make_cache(tmp_path, host_slots=4, disk_bytes=1 << 20)
    assert again.disk.num_blocks == 6
    assert _serve(again, list(range(12))).cached_by_tier == {"l3": 12}
    snapshot = {e.tier: len(e.keys) for e in again.snapshot_events()}
    assert snapshot == {"l1": 6, "l2": 4, "l3": 6}  # write-through copied to L2 what fit


def test_another_model_or_layout_never_reads_the_blocks(tmp_path: Path) -> None:
    from splitserve.radix_cache.block_hash import KVIdentity

    _serve(make_cache(tmp_path, disk_bytes=1 << 20), list(range(12)))
    other = KVIdentity("llama/abc/none/fedcba9876543210", "float32", "1x1x4/auto", 2)
    cache = make_cache(tmp_path, disk_bytes=1 << 20, identity=other)
    assert cache.disk.num_blocks == 0 and _serve(cache, list(range(12))).cached_len == 0


def _evicted_to_disk(tmp_path: Path):
    cache = make_cache(tmp_path, num_pages=8, disk_bytes=1 << 20)
    prompt = list(range(10))
    _serve(cache, prompt)
    _churn(cache)
    files = sorted(cache.disk.dir.rglob("*.kv"), key=lambda p: p.stat().st_mtime)
    return cache, prompt, files


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_a_damaged_block_is_recomputed_and_counted(tmp_path: Path, damage: str) -> None:
    cache, prompt, _ = _evicted_to_disk(tmp_path)
    keys = cache.keys_of(prompt, None)
    victim = cache.disk.path(keys[2])
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:  # another block's (valid) bytes under this name
        data = bytearray(cache.disk.path(keys[3]).read_bytes())
    victim.write_bytes(bytes(data))
    req = _serve(cache, prompt)
    assert req.cached_len == 4 and req.cached_by_tier == {"l3": 4}  # blocks 0-1; 2 recomputed
    stats = {s.tier: s for s in cache.tier_stats()}
    assert stats["l3"].corrupt_blocks == 1
    fmt, _ = cache.disk.read(keys[2])  # deleted when found bad, written again once recomputed
    assert fmt == "raw"
    _churn(cache)
    assert _serve(cache, prompt).cached_by_tier == {"l3": 10}


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                    reason="needs root to mount a small tmpfs")
def test_a_full_disk_costs_a_recompute_and_a_counter() -> None:
    root = Path(tempfile.mkdtemp())
    mount = ["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(root)]
    if subprocess.run(mount, check=False).returncode:
        pytest.skip("mount failed")
    try:
        cache = make_cache(root, num_pages=32, disk_bytes=1 << 20)  # more than the disk holds
        prompt = list(range(40))
        _serve(cache, prompt)
        stats = {s.tier: s for s in cache.tier_stats()}
        assert stats["l3"].write_errors > 0 and stats["l3"].write_blocks > 0
        assert not list(root.rglob("*.tmp-*"))  # no half-written file is left
        keys = cache.keys_of(prompt, None)
        on_disk = next(i for i, k in enumerate(keys) if not cache.disk.contains(k))
        cache.evict(cache.tree.evictable_pages)
        req = _serve(cache, prompt)  # what made it to disk comes back; the rest is computed
        assert req.cached_by_tier == ({"l3": 2 * on_disk} if on_disk else {})
    finally:
        subprocess.run(["umount", str(root)], check=False)


def test_a_worker_starts_on_a_disk_that_is_already_full() -> None:
    """The start-up read probe cannot write its file: the tier is built anyway, unmeasured."""
    from splitserve.config import EngineConfig
    from splitserve.engine.kv_pool import KVPool
    from splitserve.radix_cache.tiers.factory import create_tiered_cache
    from tests.radix_cache.tiered_fixtures import IDENTITY, LAYOUT

    root = Path(tempfile.mkdtemp())
    mount = ["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(root)]
    if subprocess.run(mount, check=False).returncode:
        pytest.skip("mount failed")
    try:
        engine = EngineConfig(model="m", kv_disk_cache_dir=str(root), kv_disk_cache_gb=1.0)
        cache = create_tiered_cache(engine, KVPool(LAYOUT, 16), IDENTITY)
        try:
            assert cache.disk is not None and cache.disk.num_blocks == 0
            assert "l3" not in cache.cost.loads  # measured by the first loads instead
        finally:
            cache.close()
    finally:
        subprocess.run(["umount", str(root)], check=False)


def test_a_load_slower_than_recomputing_is_not_done(tmp_path: Path) -> None:
    cost = LoadCostModel(bytes_per_token=LAYOUT.page_bytes / LAYOUT.page_size)
    cost.observe_prefill(1000, 1.0)  # 1 ms a token
    cost.observe_load("l3", 32, 1.0)  # 32 bytes a second: 1 s a token
    cache, prompt, _ = _evicted_to_disk(tmp_path)
    cache.cost = cache.io.cost = cost
    assert _serve(cache, prompt).cached_len == 0
    assert {s.tier: s for s in cache.tier_stats()}["l3"].skipped_slower >= 1
    for _ in range(60):  # the disk gets fast (the average follows): now the blocks load
        cost.observe_load("l3", 10**12, 1.0)
    cache.evict(cache.tree.evictable_pages)
    assert _serve(cache, prompt).cached_by_tier == {"l3": 10}


def test_an_8bit_host_tier_holds_more_blocks_and_comes_back_close(tmp_path: Path) -> None:
    from splitserve.engine.kv_pool import KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_size=2, dtype="float32")
    full = make_cache(None, host_slots=4, layout=layout)
    q8 = make_cache(None, host_slots=4, layout=layout, host_dtype="int8")
    assert q8.host.buffer.shape[1] / full.host.buffer.shape[1] < 0.3
    pool = q8.pool
    pages = pool.allocator.alloc(1)
    x = torch.randn(pool.buffer[pages[0]].shape)
    pool.buffer[pages[0]] = x
    q8.host.store(["ab" * 16], "raw", q8.rows[pages])
    back = q8.host.read(["ab" * 16]).view(torch.float32).view(x.shape)
    assert torch.allclose(back, x, atol=x.abs().max().item() / 100)


# ---- the state machine ------------------------------------------------------------------------

NUM_PAGES = 40
HOST_SLOTS = 5
MAX_HELD = 3
BASES = [(0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2), (0, 1, 2, 0, 2, 2, 1, 1, 0, 0, 1, 2), (1,) * 12]
prompts = st.builds(lambda base, cut, tail: list(base[:cut]) + tail, st.sampled_from(BASES),
                    st.integers(0, 12), st.lists(st.integers(0, 2), max_size=5))
namespaces = st.sampled_from([None, "tenant-a"])


class TieredMachine(RuleBasedStateMachine):
    """Requests, evictions and flushes against a reference that never forgets: with L3
    unbounded, every match must equal the reference's, and every lent page must hold its own
    block's K/V; the pool's pages, L2's slots and the reference stay accounted for."""

    policy = "write_through"

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp())
        self.cache = make_cache(self.tmp, num_pages=NUM_PAGES, host_slots=HOST_SLOTS,
                                disk_bytes=1 << 30, policy=self.policy)
        self.ref: set[tuple[str | None, tuple[int, ...]]] = set()
        self.held: list[Req] = []

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _expected(self, tokens: list[int], ns: str | None) -> int:
        ps = self.cache.page_size
        best = 0
        for n in range(ps, len(tokens) + 1, ps):
            if (ns, tuple(tokens[:n])) in self.ref:
                best = n
        return best

    @rule(tokens=prompts, ns=namespaces, hold=st.booleans())
    def request(self, tokens: list[int], ns: str | None, hold: bool) -> None:
        if len(tokens) < 1:
            return
        req = new_req(tokens, ns)
        admit(self.cache, req)
        assert req.matched_len == self._expected(tokens, ns)
        assert matched_content_ok(self.cache, req)
        assert sum(req.cached_by_tier.values()) == req.cached_len == req.matched_len
        compute(self.cache, req)
        ps = self.cache.page_size
        for n in range(ps, len(tokens) // ps * ps + 1, ps):
            self.ref.add((ns, tuple(tokens[:n])))
        if hold and len(self.held) < MAX_HELD:
            self.held.append(req)
        else:
            self.cache.release(req)

    @rule(data=st.data())
    def finish_held(self, data) -> None:
        if self.held:
            req = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
            self.cache.release(req)

    @rule(n=st.integers(1, 12))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @rule()
    def flush(self) -> None:
        for req in self.held:
            self.cache.release(req)
        self.held.clear()
        self.cache.flush()
        self.ref.clear()

    @invariant()
    def every_page_in_one_place(self) -> None:
        cache = self.cache
        cache.check_integrity()
        held = sum(len(r.page_ids) - r.matched_len // cache.page_size for r in self.held)
        assert cache.allocator.num_used == cache.tree.total_pages + held
        lent = [p for r in self.held for p in r.page_ids[r.matched_len // cache.page_size:]]
        tree_pages = [p for _, _, node in cache.tree.walk() for p in node.page_ids]
        assert len(set(lent + tree_pages)) == len(lent) + len(tree_pages)
        assert cache.host.num_pinned == 0  # pins live only between prefetch and admission


class TieredWriteBackMachine(TieredMachine):
    policy = "write_back"


TestTieredWriteThrough = TieredMachine.TestCase
TestTieredWriteThrough.settings = settings(max_examples=60, stateful_step_count=30,
                                           deadline=None)
TestTieredWriteBack = TieredWriteBackMachine.TestCase
TestTieredWriteBack.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_lora_adapters_never_share_in_any_tier(tmp_path: Path) -> None:
    """A worker folds a request's adapter digest into its namespace (``worker.tasks.new_req``:
    ``radix_cache.namespace.adapter_namespace``), which is part of every block key's chain root:
    the radix tree and each tier keep the base model's and each adapter's blocks apart, and the
    same adapter files (same digest) hit again after the blocks went down the tiers."""
    cache = make_cache(tmp_path, num_pages=8, host_slots=4, disk_bytes=1 << 20)
    prompt = list(range(10))
    ns = {d: adapter_namespace("tenant-a", d) for d in ("", "digest-sql", "digest-chat")}
    assert ns[""] == "tenant-a" and len(set(ns.values())) == 3
    assert len({tuple(cache.keys_of(prompt, n)) for n in ns.values()}) == 3
    _serve(cache, prompt, ns["digest-sql"])
    assert _serve(cache, prompt, ns["digest-chat"]).cached_len == 0  # in the pool (L1)
    cache.evict(cache.tree.evictable_pages)
    _churn(cache)
    assert _serve(cache, prompt, ns[""]).cached_len == 0
    again = _serve(cache, prompt, ns["digest-sql"])
    assert again.cached_len == 10 and "l1" not in again.cached_by_tier
