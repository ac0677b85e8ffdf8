"""``GET /metrics`` in Prometheus text format.

Request latencies are observed by the engine client as tokens reach the server (TTFT, the time
between tokens, end to end); worker gauges and counters are read at scrape time from the
workers' latest heartbeats (at most half a second old).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from splitserve.config.registry import GRAMMAR_BACKEND, WORKER_ROLE
from splitserve.observe.timing import STAGES
from splitserve.server.engine_client import TokenEvent

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RequestTimer:
    """Times one request: call :meth:`on_event` for every event it yields. ``timing``: its
    ``observe.timing.RequestTiming`` (filled by the caller), whose stages are observed when it
    finishes."""

    def __init__(self, metrics: ServerMetrics, timing: Any = None) -> None:
        self.m = metrics
        self.timing = timing
        self.start = self.last = time.monotonic()
        self.num_tokens = 0

    def on_event(self, ev: TokenEvent) -> None:
        now = time.monotonic()
        if ev.token_ids:
            self.m.generation_tokens.inc(len(ev.token_ids))
            if self.num_tokens == 0:
                self.m.ttft.observe(now - self.start)
            else:
                # Tokens that come together share the gap since the previous event.
                gap = (now - self.last) / len(ev.token_ids)
                for _ in ev.token_ids:
                    self.m.itl.observe(gap)
            self.num_tokens += len(ev.token_ids)
            self.last = now
        for tier, n in ev.cached_by_tier.items():
            self.m.cached_tokens.labels(tier).inc(n)
        if ev.error is not None:
            self.m.requests.labels("error").inc()
        elif ev.finish_reason is not None:
            self.m.e2e.observe(now - self.start)
            self.m.requests.labels("finished").inc()
            self.m.prompt_tokens.inc(ev.prompt_len)
            self.m.cached_prompt_tokens.inc(ev.cached_len)
            if self.timing is not None:
                stage = self.m.stage
                for name, seconds in self.timing.stages().items():
                    stage.labels(name).observe(seconds)

    def rejected(self) -> None:
        self.m.requests.labels("rejected").inc()


class ServerMetrics:
    """The router's metrics, in their own registry (so several apps can live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("splitserve_time_to_first_token_seconds",
                              "Time from request arrival to its first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("splitserve_inter_token_latency_seconds",
                             "Time between consecutive output tokens", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("splitserve_e2e_request_latency_seconds",
                             "Time from arrival to the last token of finished requests",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("splitserve_requests", "Requests by outcome (finished, error, "
                                "rejected = refused before start: 503 or 429)", ["outcome"],
                                registry=r)
        self.worker_failures = Counter("splitserve_worker_failures",
                                       "Workers declared dead (connection lost or silent)", ["role"],
                                       registry=r)
        self.retries = Counter("splitserve_request_retries", "Requests re-run on other workers "
                               "after losing one before their first token", registry=r)
        # A finished json_schema output that jsonschema refuses (server.constraint_check).
        self.constraint_violations = Counter(
            "splitserve_constraint_violations", "Finished json_schema outputs that broke their "
            "schema, by the grammar backend the worker reported compiling it", ["backend"],
            registry=r)
        # The timing breakdown's stages (observe.timing), per finished request.
        self.stage = Histogram("splitserve_request_stage_seconds", "Time of each request stage "
                               "(server, queue, prefill, transfer, decode, deliver), finished "
                               "requests", ["stage"], buckets=LATENCY_BUCKETS, registry=r)
        self.generation_tokens = Counter("splitserve_generation_tokens", "Output tokens "
                                         "delivered to clients", registry=r)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.cached_prompt_tokens = Counter("splitserve_prompt_cached_tokens", "Prompt tokens of "
                                            "finished requests served from a prefix cache",
                                            registry=r)
        # Every label value a dashboard names is exposed from the start (at 0), so a query of
        # a failure that has not happened yet reads 0 rather than nothing.
        for outcome in ("finished", "error", "rejected"):
            self.requests.labels(outcome)
        for role in WORKER_ROLE.names:
            self.worker_failures.labels(role)
        for backend in GRAMMAR_BACKEND.names:
            self.constraint_violations.labels(backend)
        for stage in STAGES:
            self.stage.labels(stage)
        # Refused before any route ran (server.browser_guard): a page of another origin, or a
        # POST body that is not JSON.
        self.refused = Counter("splitserve_requests_refused", "Requests refused before any "
                               "route ran, by reason (origin, content_type)", ["reason"],
                               registry=r)
        for reason in ("origin", "content_type"):
            self.refused.labels(reason)
        # Prompt tokens served from a prefix-cache tier (l1 pool, l2 host memory, l3 disk,
        # store shared), as each request's worker reported them.
        self.cached_tokens = Counter("splitserve_cached_prompt_tokens", "Prompt tokens served "
                                     "from the prefix cache, by the tier that held them",
                                     ["tier"], registry=r)
        self.pool: Any = None

    def count_refused(self, reason: str) -> None:
        """One request refused by ``server.browser_guard`` for ``reason``."""
        self.refused.labels(reason).inc()

    def request_timer(self, timing: Any = None) -> RequestTimer:
        return RequestTimer(self, timing)

    def attach(self, pool: Any) -> None:
        """Report the workers of ``pool`` (a ``server.worker_pool.WorkerPool``) at scrape time."""
        self.pool = pool
        self.registry.register(_WorkerCollector(pool))

    def attach_gate(self, gate: Any) -> None:
        """Report the router's admission gate (a ``server.admission.AdmissionGate``) at scrape
        time: slots in use, requests waiting, and how many waited or were refused (429)."""
        self.registry.register(_GateCollector(gate))


class _GateCollector:
    def __init__(self, gate: Any) -> None:
        self.gate = gate

    def collect(self):
        g = self.gate
        yield GaugeMetricFamily("splitserve_router_slots_in_use", "Requests the router runs on "
                                "its workers (each holds a slot of --max-inflight-per-worker)",
                                value=g.in_use)
        yield GaugeMetricFamily("splitserve_router_queue_waiting", "Requests waiting at the "
                                "router for a slot (fair queue over tenants)", value=g.waiting)
        yield CounterMetricFamily("splitserve_router_queued", "Requests admitted after waiting "
                                  "for a slot", value=g.num_queued)
        yield CounterMetricFamily("splitserve_router_queue_refused", "Requests refused with 429 "
                                  "because the router's queue was full", value=g.num_refused)
        yield CounterMetricFamily("splitserve_router_queue_expired", "Requests refused with 429 "
                                  "after waiting --max-queue-wait for a slot",
                                  value=g.num_expired)


_GAUGES = {
    "pages_used": "KV pages in use",
    "pages_total": "KV pages in the pool",
    "num_running": "Requests in the running batch",
    "num_waiting": "Requests queued (waiting for prefill or for pages)",
    "num_transferring": "Requests with a KV transfer in progress",
    "cache_pages": "KV pages owned by the prefix cache",
    "cache_evictable_pages": "Prefix-cache pages no request pins",
    "kv_gbps": "KV transfer throughput (GB/s) over the worker's lifetime",
    "kv_pool_bytes": "Bytes of the KV pool",
    "decode_cache_bytes": "Bytes of the decode rows' K/V copy (CPU bfloat16)",
    "weight_bytes": "Bytes of the weights and their packed copies",
}
_COUNTERS = {
    "kv_bytes_sent": "KV bytes sent to decode workers",
    "kv_bytes_received": "KV bytes received from prefill workers",
    "transfer_failures": "Requests failed because their KV transfer failed or timed out",
    "requests_failed": "Requests a worker failed",
    "requests_orphaned": "Requests a worker ended because their router went away",
    "cache_hit_tokens": "Prompt tokens served from the prefix cache",
    "cache_prompt_tokens": "Prompt tokens admitted (the hit rate's denominator)",
    "cache_evicted_pages": "Prefix-cache pages evicted",
    "kv_pages_sent": "KV pages sent to decode workers",
    "kv_pages_received": "KV pages received from prefill workers",
    "spec_draft_tokens": "Speculative draft tokens proposed (--speculative)",
    "spec_accepted_tokens": "Speculative draft tokens kept by verification",
    "tokens_generated": "Output tokens the worker sent to routers",
    "steps_interrupted": "Steps given up between layers for a more urgent prompt",
}


class _WorkerCollector:
    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def collect(self):
        labels = ["worker_id", "role"]
        fams = {k: GaugeMetricFamily(f"splitserve_worker_{k}", h, labels=labels)
                for k, h in _GAUGES.items()}
        fams |= {k: CounterMetricFamily(f"splitserve_worker_{k}", h, labels=labels)
                 for k, h in _COUNTERS.items()}
        healthy = GaugeMetricFamily("splitserve_worker_healthy", "1 if the worker is healthy",
                                    labels=labels)
        in_flight = GaugeMetricFamily("splitserve_worker_in_flight",
                                      "Requests the router has in flight on the worker", labels=labels)
        for w in self.pool.workers:
            lv = [w.worker_id, w.role]
            healthy.add_metric(lv, 1.0 if w.ready else 0.0)
            in_flight.add_metric(lv, w.in_flight)
            for k, fam in fams.items():
                if k in w.last_stats:
                    fam.add_metric(lv, w.last_stats[k])
        yield from fams.values()
        yield healthy
        yield in_flight
        yield from _tier_families(self.pool.workers)


# Per worker and cache tier (WorkerStats.cache_tiers): gauges, then counters.
_TIER_GAUGES = {
    "capacity_bytes": "Bytes a prefix-cache tier may hold",
    "used_bytes": "Bytes a prefix-cache tier holds",
    "blocks": "KV blocks (pages) a prefix-cache tier holds",
    "load_gbps": "Measured load rate of a prefix-cache tier (GB/s)",
}
_TIER_COUNTERS = {
    "hit_tokens": "Prompt tokens a prefix-cache tier served",
    "load_bytes": "Bytes loaded from a prefix-cache tier into the KV pool",
    "load_s": "Seconds spent loading from a prefix-cache tier",
    "write_bytes": "Bytes written to a prefix-cache tier",
    "write_errors": "Writes to a prefix-cache tier that failed (disk full, store gone)",
    "dropped_writes": "Writes to a prefix-cache tier dropped (write queue full)",
    "corrupt_blocks": "Blocks that failed their checksum when read (recomputed)",
    "unavailable": "Loads skipped because a prefix-cache tier did not answer",
    "skipped_slower": "Blocks not loaded because recomputing them was measured faster",
}


def _tier_families(workers: list) -> list:
    labels = ["worker_id", "role", "tier"]
    fams = {k: GaugeMetricFamily(f"splitserve_cache_tier_{k}", h, labels=labels)
            for k, h in _TIER_GAUGES.items()}
    fams |= {k: CounterMetricFamily(f"splitserve_cache_tier_{k}", h, labels=labels)
             for k, h in _TIER_COUNTERS.items()}
    for w in workers:
        for row in w.last_stats.get("cache_tiers", ()):
            for k, fam in fams.items():
                fam.add_metric([w.worker_id, w.role, row["tier"]], row[k])
    return list(fams.values())


def install_metrics(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
