"""The router's KV-event index (``server.kv_index``): after a churn of requests through a
worker's tiered cache (no model), the index built from the worker's events, sent through the
wire format, holds exactly the blocks the worker's pool, host memory and disk hold; the
cache-aware policy routes to the worker whose tiers hold a prefix, and two routers fed the same
events agree."""

from __future__ import annotations

import random
from pathlib import Path

from splitserve.ipc.messages import KVEvent, KVEvents, decode, encode
from splitserve.radix_cache.block_hash import block_keys, chain_root
from splitserve.server.kv_index import KVEventIndex
from splitserve.server.routing import CacheAwarePolicy
from tests.radix_cache.tiered_fixtures import admit, compute, make_cache, new_req

ADDR = "tcp://127.0.0.1:1"


class _Worker:
    """A worker's cache and the KV events it would publish."""

    def __init__(self, cache, addr: str = ADDR) -> None:
        self.cache, self.addr, self.seq = cache, addr, 0

    def message(self, events: list[KVEvent] | None = None, snapshot: bool = False) -> KVEvents:
        if not snapshot:
            self.seq += 1
        msg = KVEvents(worker_id="w", addr=self.addr, identity=self.cache.identity,
                       page_size=self.cache.page_size, seq=self.seq,
                       events=self.cache.drain_events() if events is None else events,
                       snapshot=snapshot)
        return decode(encode(msg))  # through the wire format


def _actual(cache) -> dict[str, set[str]]:
    held: dict[str, set[str]] = {}
    for tier, keys in (("l1", cache._l1_keys()), ("l2", cache.host.keys()),
                       ("l3", cache.disk.keys())):
        for key in keys:
            held.setdefault(key, set()).add(tier)
    return held


def test_the_index_agrees_with_the_worker_after_a_churn(tmp_path: Path) -> None:
    rng = random.Random(7)
    for policy in ("write_through", "write_back"):
        cache = make_cache(tmp_path / policy, num_pages=24, host_slots=6, disk_bytes=3000,
                           policy=policy)  # ~30 blocks on disk: L3 evicts too
        worker, index = _Worker(cache), KVEventIndex()
        assert index.apply(worker.message([], snapshot=True))  # what a worker sends at start
        bases = [[rng.randrange(50) for _ in range(20)] for _ in range(4)]
        for step in range(300):
            base = rng.choice(bases)
            tokens = base[: rng.randrange(1, 21)] + [rng.randrange(50) for _ in range(3)]
            req = new_req(tokens, rng.choice([None, "tenant-a"]))
            admit(cache, req)
            compute(cache, req)
            cache.release(req)
            if step % 37 == 0:
                cache.evict(rng.randrange(1, 10))
            if step == 150:
                cache.flush()
            assert index.apply(worker.message())
            assert index.workers[ADDR].tiers == _actual(cache), step
        # A router that joins now asks for a snapshot and gets the same view.
        late = KVEventIndex()
        assert not late.apply(worker.message([]))  # seq > 1: a gap
        late.apply(worker.message(cache.snapshot_events(), snapshot=True))
        assert late.workers[ADDR].tiers == _actual(cache)


class _Handle:
    def __init__(self, addr: str) -> None:
        self.addr, self.in_flight = addr, 0


def _events(addr: str, identity: str, keys: list[str], tier: str) -> KVEvents:
    """A worker's first message: a snapshot of what it holds."""
    return KVEvents(worker_id=addr, addr=addr, identity=identity, page_size=16, seq=0,
                    events=[KVEvent("stored", tier, keys)], snapshot=True)


def test_routing_follows_the_blocks_the_workers_report() -> None:
    identity = "ab" * 16
    prompt = list(range(200))
    keys = block_keys(chain_root(identity, None), prompt[:-1], 16)
    a, b = _Handle("tcp://a"), _Handle("tcp://b")
    routers = [CacheAwarePolicy(), CacheAwarePolicy()]
    for policy in routers:  # b reports the prompt on its disk; a reports something else
        assert policy.observe(_events(b.addr, identity, keys, "l3"))
        assert policy.observe(_events(a.addr, identity, keys[:2], "l1"))
    assert [p.pick([a, b], prompt).addr for p in routers] == [b.addr, b.addr]
    # Another tenant's request matches nothing there: the least loaded (ties: a) gets it.
    assert routers[0].pick([a, b], prompt, "tenant-x").addr == a.addr
    # A shared store's blocks count for every worker that reads it; memory tiers break ties.
    store = CacheAwarePolicy()
    for w, tier in ((a, "l1"), (b, "l3")):
        msg = _events(w.addr, identity, keys[:4], tier)
        msg.store = "mooncake://m:1"
        store.observe(msg)
    shared = KVEvents(worker_id="b", addr=b.addr, identity=identity, page_size=16, seq=1,
                      events=[KVEvent("stored", "store", keys)], store="mooncake://m:1")
    assert store.observe(shared)
    assert store.index.match(a.addr, prompt, None).tokens == len(keys) * 16
    assert store.pick([a, b], prompt).addr == a.addr  # a has more of it in memory
    # A worker that died is forgotten.
    store.forget(a.addr)
    assert store.index.match(a.addr, prompt, None).tokens == 0
