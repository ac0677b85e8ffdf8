"""``GET /metrics``: the workers' stats in Prometheus text format.

Rendered from a fresh registry per scrape: the numbers live in the workers and are read on
demand (``WorkerStats``), so there is no process-wide metric state to keep in sync.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest

# WorkerStats field -> (metric name, help). Running counts keep the ``_total`` suffix.
_FIELDS: dict[str, tuple[str, str]] = {
    "pages_total": ("splitserve_kv_pages_total_capacity", "KV pages in the pool"),
    "pages_used": ("splitserve_kv_pages_used", "KV pages in use (requests + prefix cache)"),
    "num_running": ("splitserve_requests_running", "requests in the running batch"),
    "num_waiting": ("splitserve_requests_waiting", "requests waiting for admission"),
    "num_transferring": ("splitserve_requests_transferring", "requests in KV transfer"),
    "cache_pages": ("splitserve_prefix_cache_pages", "KV pages owned by the prefix cache"),
    "cache_evictable_pages": (
        "splitserve_prefix_cache_evictable_pages",
        "prefix-cache pages no request pins",
    ),
    "cache_hit_tokens": (
        "splitserve_prefix_cache_hit_tokens_total",
        "prompt tokens served from the cache",
    ),
    "cache_prompt_tokens": (
        "splitserve_prefix_cache_prompt_tokens_total",
        "prompt tokens admitted",
    ),
    "cache_evicted_pages": (
        "splitserve_prefix_cache_evicted_pages_total",
        "prefix-cache pages evicted",
    ),
}


def render_metrics(rows: list[dict]) -> bytes:
    """Prometheus exposition text for ``rows`` (``BaseEngineClient.worker_stats`` output).

    Counters are exported as gauges of their current value: the worker owns the count, this
    process only reports it (a restarted worker starts again from zero, as a counter would).
    """
    registry = CollectorRegistry()
    gauges = {
        field: Gauge(name, help_text, ["worker_id", "role"], registry=registry)
        for field, (name, help_text) in _FIELDS.items()
    }
    healthy = Gauge(
        "splitserve_worker_healthy",
        "1 if the worker answered",
        ["worker_id", "role"],
        registry=registry,
    )
    for row in rows:
        labels = (str(row.get("worker_id", "")), str(row.get("role", "")))
        healthy.labels(*labels).set(1 if row.get("healthy") else 0)
        for field, gauge in gauges.items():
            if field in row:
                gauge.labels(*labels).set(row[field])
    return generate_latest(registry)
