"""The ``x-splitserve-cached-tokens`` response header: how many of a request's prompt tokens each
prefix-cache tier served (``l1`` the worker's KV pool, ``l2`` host memory, ``l3`` its disk,
``store`` the store the workers share; ``radix_cache.tiered_cache``), e.g.
``total=96; l1=32; l2=0; l3=64; store=0``. ``total`` is ``usage.prompt_tokens_details.
cached_tokens``; OpenAI's body has no place for the split, so it rides in a header, streamed or
not (a stream's headers go with its first chunk, after the worker matched the prompt).
"""

from __future__ import annotations

from splitserve.server.formatter import Usage

CACHE_HEADER = "x-splitserve-cached-tokens"
TIERS = ("l1", "l2", "l3", "store")


def cache_header(usage: Usage) -> dict[str, str]:
    """``{CACHE_HEADER: "total=N; l1=..; l2=..; l3=..; store=.."}`` for ``usage`` (a worker
    without tiers reports every cached token as ``l1``)."""
    by = dict(usage.cached_by_tier)
    by["l1"] = by.get("l1", 0) + usage.cached_tokens - sum(by.values())
    parts = [f"total={usage.cached_tokens}"] + [f"{t}={by.get(t, 0)}" for t in TIERS]
    return {CACHE_HEADER: "; ".join(parts)}
