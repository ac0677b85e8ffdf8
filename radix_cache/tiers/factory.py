"""Build the tiered prefix cache of one worker from its configuration, and measure each tier's
load rate once at start-up (the rule that decides load or recompute needs it from the first
request on; ``cost_model``)."""

from __future__ import annotations

import logging
import os
import time

import torch

from splitserve.config import EngineConfig
from splitserve.engine.kv_pool import KVPool
from splitserve.radix_cache.block_hash import KVIdentity
from splitserve.radix_cache.tiered_cache import TieredPrefixCache
from splitserve.radix_cache.tiers.block_format import BlockFormat
from splitserve.radix_cache.tiers.cost_model import LoadCostModel
from splitserve.radix_cache.tiers.disk_tier import DiskTier
from splitserve.radix_cache.tiers.host_tier import HostTier
from splitserve.radix_cache.tiers.store_tier import MooncakeStoreTier, StoreUnavailable

logger = logging.getLogger(__name__)

PROBE_BYTES = 8 << 20  # what each start-up probe reads


def create_tiered_cache(engine: EngineConfig, pool: KVPool, identity: KVIdentity,
                        local_host: str = "127.0.0.1") -> TieredPrefixCache:
    """The prefix cache of a prefill or colocated worker: the radix tree over ``pool`` with
    the tiers ``engine`` names below it (none: the pool alone, still publishing KV events).

    Args:
        engine: the worker's engine config (``kv_host_cache_*``, ``kv_disk_cache_*``,
            ``kv_cache_write_policy``, ``kv_store``).
        pool: the KV pool.
        identity: the model, dtype and layout (the root of every block key).
        local_host: this worker's address as the store's other clients reach it.

    Raises:
        ValueError: ``kv_store`` is ``local`` (the launcher resolves it) or malformed.
        ImportError: a store is named but the ``mooncake`` extra is not installed.
    """
    layout = pool.layout
    fmt = BlockFormat(layout, engine.kv_host_cache_dtype)
    cost = LoadCostModel(bytes_per_token=layout.page_bytes / layout.page_size)
    host = disk = store = None
    if engine.kv_host_cache_mb:
        host = HostTier(max(1, engine.kv_host_cache_mb * 2**20 // fmt.block_bytes), fmt)
    if engine.kv_disk_cache_dir:
        disk = DiskTier(engine.kv_disk_cache_dir, identity.digest(),
                        int(engine.kv_disk_cache_gb * 1e9), fmt.sizes)
        _probe_disk(disk, cost)
        rate = cost.loads.get("l3")  # none when the probe failed (a full disk)
        logger.info("L3 %s: %d blocks from earlier runs, read at %.2f GB/s", disk.dir,
                    disk.num_blocks, (rate.value or 0) / 1e9 if rate else 0.0)
    if engine.kv_store == "local":
        raise ValueError("kv_store 'local' is resolved by splitserve launch/serve; a worker "
                         "started alone needs mooncake://HOST:PORT")
    if engine.kv_store:
        try:
            store = MooncakeStoreTier(engine.kv_store, local_host,
                                      engine.kv_store_segment_mb * 2**20, fmt.sizes)
        except StoreUnavailable as exc:
            # Serve without it: every prompt is computed, as if the store were empty.
            logger.error("%s: serving without the shared KV store", exc)
        else:
            _probe_store(store, cost, fmt)
    return TieredPrefixCache(pool.allocator, layout.page_size, pool=pool, identity=identity,
                             fmt=fmt, host=host, disk=disk, store=store,
                             write_policy=engine.kv_cache_write_policy, cost=cost)


def _probe_disk(disk: DiskTier, cost: LoadCostModel) -> None:
    """Write then read back ``PROBE_BYTES`` in the tier's directory: its read rate as loads see
    it (the page cache included, as for blocks written recently)."""
    path = disk.dir / f"probe.tmp-{os.getpid()}"
    data = os.urandom(PROBE_BYTES)
    try:
        path.write_bytes(data)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            got = f.read()
        cost.observe_load("l3", len(got), time.perf_counter() - t0)
    except OSError as exc:
        logger.warning("L3 read probe failed (%s): its rate is measured by the first loads", exc)
    finally:
        path.unlink(missing_ok=True)


def _probe_store(store: MooncakeStoreTier, cost: LoadCostModel, fmt: BlockFormat) -> None:
    """Put then read back a few blocks of random bytes under probe keys."""
    n = max(1, min(16, PROBE_BYTES // fmt.sizes["raw"]))
    keys = [os.urandom(16).hex() for _ in range(n)]
    payload = torch.randint(0, 255, (fmt.sizes["raw"],), dtype=torch.uint8)
    try:
        for key in keys:
            store.write(key, "raw", memoryview(payload.numpy()))
        t0 = time.perf_counter()
        got = store.read_run(keys)
        if got:
            cost.observe_load("store", sum(p.numel() for _, p in got), time.perf_counter() - t0)
    except OSError as exc:
        logger.warning("KV store probe failed (%s): its rate is measured by the first loads", exc)
    finally:
        for key in keys:
            store.remove(key)
