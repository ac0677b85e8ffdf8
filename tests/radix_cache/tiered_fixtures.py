"""A tiered prefix cache over a tiny real KV pool, with no model: each cached page's K/V bytes
are a function of its block key, so a test can check that every page a match lends holds the
KV of exactly those tokens after that prefix (never another block's, another tenant's, or a
corrupted one)."""

from __future__ import annotations

from pathlib import Path

import torch

from splitserve.engine.kv_pool import KVLayout, KVPool, pages_for
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams
from splitserve.radix_cache.block_hash import KVIdentity
from splitserve.radix_cache.tiered_cache import TieredPrefixCache
from splitserve.radix_cache.tiers.block_format import BlockFormat
from splitserve.radix_cache.tiers.cost_model import LoadCostModel
from splitserve.radix_cache.tiers.disk_tier import DiskTier
from splitserve.radix_cache.tiers.host_tier import HostTier

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=2, dtype="float32")
IDENTITY = KVIdentity("llama/abc/none/0123456789abcdef", "float32", "1x1x4/auto", 2)


def make_cache(tmp: Path | None, *, num_pages: int = 48, host_slots: int = 0,
               disk_bytes: int = 0, policy: str = "write_through", host_dtype: str = "auto",
               layout: KVLayout = LAYOUT, cost: LoadCostModel | None = None,
               identity: KVIdentity = IDENTITY) -> TieredPrefixCache:
    """A cache over a fresh pool; L2 with ``host_slots`` slots, L3 of ``disk_bytes`` under
    ``tmp`` (0: none). Loads and writes run inline."""
    pool = KVPool(layout, num_pages)
    fmt = BlockFormat(layout, host_dtype)
    host = HostTier(host_slots, fmt) if host_slots else None
    disk = DiskTier(tmp, identity.digest(), disk_bytes, fmt.sizes) if disk_bytes else None
    return TieredPrefixCache(pool.allocator, layout.page_size, pool=pool, identity=identity,
                             fmt=fmt, host=host, disk=disk, write_policy=policy, cost=cost,
                             threaded=False)


def page_content(key: str, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """The K/V of the block named ``key``: its 16 digest bytes, repeated, as floats."""
    n = layout.num_layers * 2 * layout.page_size * layout.num_kv_heads * layout.head_dim
    raw = torch.tensor(list(bytes.fromhex(key)), dtype=torch.float32)
    return raw.repeat((n + 15) // 16)[:n].view(layout.num_layers, 2, layout.page_size,
                                                layout.num_kv_heads, layout.head_dim)


def new_req(tokens: list[int], namespace: str | None = None) -> Req:
    """A request for ``tokens`` plus one more, so a match may cover all of ``tokens``."""
    return Req(rid=f"r{len(tokens)}", input_ids=list(tokens) + [7],
               sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
               cache_namespace=namespace)


def admit(cache: TieredPrefixCache, req: Req) -> None:
    """What the scheduler does for a new request: prefetch, match, allocate the rest, admit."""
    cache.prefetch(req)
    assert cache.ready(req)
    cache.match(req)
    need = pages_for(req.seq_len, cache.page_size) - len(req.page_ids)
    assert cache.ensure_free(need), "the test's pool is sized so admission never fails"
    req.page_ids += cache.allocator.alloc(need)
    cache.admitted(req)


def compute(cache: TieredPrefixCache, req: Req) -> None:
    """'Prefill' the request: write each computed full page's K/V, as a model would, and share
    them at once, as the scheduler does after a prompt chunk (``cache_prefix``)."""
    ps = cache.page_size
    tokens = req.tokens(0, req.prompt_len - 1)
    keys = cache.keys_of(tokens, req.cache_namespace)
    for i in range(req.matched_len // ps, len(keys)):
        cache.pool.buffer[req.page_ids[i]] = page_content(keys[i])
    req.kv_len = req.prompt_len - 1
    cache.cache_prefix(req)


def matched_content_ok(cache: TieredPrefixCache, req: Req) -> bool:
    """Whether every page the match lent holds the KV of its block."""
    keys = cache.keys_of(req.tokens(0, req.matched_len), req.cache_namespace)
    return all(torch.equal(cache.pool.buffer[p], page_content(k))
               for p, k in zip(req.page_ids, keys))
