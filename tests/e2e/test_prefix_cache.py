"""The prefix cache through launched clusters: a second request with the same long prefix
reports cached tokens and gets the same greedy tokens; pages come back; /flush_cache empties."""

from __future__ import annotations

import time

import httpx

from tests.e2e.conftest import complete_ids, flush_cache

SYSTEM = (
    "You are a careful assistant. Answer with one short sentence. Facts: the Nile is the longest "
    "river in Africa; Mount Everest is the highest mountain above sea level; the Pacific is the "
    "largest ocean; Canberra is the capital of Australia; water boils at 100 degrees Celsius at "
    "sea level; the Moon orbits the Earth about once every 27 days.\n"
)


def _rows(cluster) -> list[dict]:
    return httpx.get(cluster.config.url + "/workers", timeout=10).json()


def _wait_idle(cluster, timeout_s: float = 10.0) -> list[dict]:
    """Rows once no request holds pages (the prefill side frees after its KV send)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = _rows(cluster)
        if all(r["pages_used"] == r["cache_pages"] for r in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_shared_prefix_is_cached_and_pages_return(cluster, tokenizer) -> None:
    before = flush_cache(cluster)
    assert all(r["pages_used"] == 0 for r in before)
    first = tokenizer.encode(SYSTEM + "Q: What is the largest ocean?\nA:")
    second = tokenizer.encode(SYSTEM + "Q: What is the capital of Australia?\nA:")
    assert len(first) > 64

    a = complete_ids(cluster, first, 8)
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    warm = complete_ids(cluster, second, 8)
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    page = cluster.config.engine.page_size
    assert cached == shared // page * page > 0

    rows = _wait_idle(cluster)
    for r in rows:  # every used page is the cache's and none is pinned
        assert r["pages_used"] == r["cache_pages"] == r["cache_evictable_pages"], r
    hits = sum(r["cache_hit_tokens"] for r in rows) - sum(r["cache_hit_tokens"] for r in before)
    assert hits == cached  # counters are since start: other tests of the session add to them
    metrics = httpx.get(cluster.config.url + "/metrics", timeout=10).text
    assert "splitserve_worker_cache_hit_tokens_total{" in metrics

    assert all(r["pages_used"] == 0 for r in flush_cache(cluster))
    cold = complete_ids(cluster, second, 8)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["choices"][0]["token_ids"] == warm["choices"][0]["token_ids"]
    _wait_idle(cluster)
    assert all(r["pages_used"] == 0 for r in flush_cache(cluster))
