"""``GET /cluster``: the live state of the cluster as one small JSON document, for the web page's
cluster view (``server.ui``) and ``splitserve top``.

Per worker: its role, health, draining, pages used of total, running and waiting requests,
requests in flight from this router, KV transfers in flight, cache hit rate, and its output
tokens/s and KV transfer MB/s over the last interval (from its heartbeats' counters). For the
cluster: a history of the last ``history`` intervals (10 minutes by default) of requests/s,
tokens/s and the mean and 90th percentile of TTFT and inter-token latency, each from the
router's own Prometheus histograms (``server.metrics``), differenced interval by interval.

A :class:`ClusterView` samples every ``interval_s`` on the server's event loop
(:meth:`ClusterView.run`, started with the app); reading numbers it already has, it costs the
request path nothing.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from typing import Any

from fastapi import FastAPI, Request

from splitserve.server.errors import APIError
from splitserve.server.tenancy import require_operator

INTERVAL_S = 2.0
HISTORY = 300  # intervals kept: 10 minutes at 2 s


def _histogram_state(hist: Any) -> tuple[float, float, list[tuple[float, float]]]:
    """``(count, sum, [(upper bound, cumulative count), ...])`` of an unlabelled histogram."""
    count = total = 0.0
    buckets: list[tuple[float, float]] = []
    for family in hist.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                count = s.value
            elif s.name.endswith("_sum"):
                total = s.value
    return count, total, buckets


def _total(counter: Any, **labels: str) -> float:
    """A counter's value (summed over the samples whose labels include ``labels``)."""
    return sum(s.value for f in counter.collect() for s in f.samples
               if s.name.endswith("_total") and labels.items() <= s.labels.items())


def _interval_stats(before: tuple, after: tuple) -> tuple[float | None, float | None]:
    """Mean and 90th percentile (linear within its bucket, as Prometheus' histogram_quantile)
    of the observations between two :func:`_histogram_state` readings; None when none."""
    n = after[0] - before[0]
    if n <= 0:
        return None, None
    mean = (after[1] - before[1]) / n
    rank, lower, below = 0.9 * n, 0.0, 0.0
    for (bound, cum_a), (_, cum_b) in zip(after[2], before[2]):
        cum = cum_a - cum_b
        if cum >= rank:
            if math.isinf(bound):
                return mean, lower
            share = (rank - below) / max(cum - below, 1e-12)
            return mean, lower + (bound - lower) * share
        lower, below = bound, cum
    return mean, lower


class ClusterView:
    """The history and per-worker rates behind ``GET /cluster``.

    Args:
        pool: the router's ``server.worker_pool.WorkerPool``.
        metrics: its ``server.metrics.ServerMetrics``.
        model: the served model's name.
        interval_s: seconds between samples; ``history``: samples kept.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, pool: Any, metrics: Any, model: str, interval_s: float = INTERVAL_S,
                 history: int = HISTORY, clock=time.monotonic) -> None:
        self.pool, self.metrics, self.model = pool, metrics, model
        self.interval_s = interval_s
        self.clock = clock
        self.history: deque[dict[str, Any]] = deque(maxlen=history)
        self.rates: dict[str, dict[str, float]] = {}
        self._last: dict[str, Any] | None = None
        self._workers: dict[str, tuple[float, float, float]] = {}

    def _reading(self) -> dict[str, Any]:
        m = self.metrics
        return {"t": self.clock(), "ttft": _histogram_state(m.ttft), "itl": _histogram_state(m.itl),
                "tokens": _total(m.generation_tokens),
                "finished": _total(m.requests, outcome="finished")}

    def sample(self) -> None:
        """Take one sample: the cluster's interval stats, each worker's rates."""
        now = self._reading()
        last, self._last = self._last, now
        for w in self.pool.workers:
            st = w.last_stats
            kv = float(st.get("kv_bytes_sent", 0) + st.get("kv_bytes_received", 0))
            tokens = float(st.get("tokens_generated", 0))
            prev = self._workers.get(w.worker_id)
            self._workers[w.worker_id] = (now["t"], tokens, kv)
            if prev is not None and now["t"] > prev[0]:
                dt = now["t"] - prev[0]
                self.rates[w.worker_id] = {"tokens_per_s": max(0.0, tokens - prev[1]) / dt,
                                           "kv_mb_per_s": max(0.0, kv - prev[2]) / dt / 1e6}
        if last is None or now["t"] <= last["t"]:
            return
        dt = now["t"] - last["t"]
        ttft_mean, ttft_p90 = _interval_stats(last["ttft"], now["ttft"])
        itl_mean, itl_p90 = _interval_stats(last["itl"], now["itl"])
        self.history.append({
            "t": time.time(),
            "requests_per_s": (now["finished"] - last["finished"]) / dt,
            "tokens_per_s": (now["tokens"] - last["tokens"]) / dt,
            "ttft_mean_s": ttft_mean, "ttft_p90_s": ttft_p90,
            "itl_mean_s": itl_mean, "itl_p90_s": itl_p90,
        })

    async def run(self) -> None:
        """Sample every ``interval_s`` until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def snapshot(self, operator: bool) -> dict[str, Any]:
        """The ``GET /cluster`` document (``operator``: whether the caller may drain)."""
        workers = []
        for w in self.pool.workers:
            st = w.last_stats
            prompt = st.get("cache_prompt_tokens", 0)
            workers.append({
                "worker_id": w.worker_id, "role": w.role, "healthy": bool(w.ready),
                "draining": w.draining, "in_flight": w.in_flight, "failures": w.failures,
                "node": st.get("node", ""),
                "pages_used": st.get("pages_used", 0), "pages_total": st.get("pages_total", 0),
                "num_running": st.get("num_running", 0), "num_waiting": st.get("num_waiting", 0),
                "num_transferring": st.get("num_transferring", 0),
                "cache_hit_rate": st.get("cache_hit_tokens", 0) / prompt if prompt else None,
                "tokens_generated": st.get("tokens_generated", 0),
                "kv_transfer": st.get("kv_transfer", ""),
                **self.rates.get(w.worker_id, {"tokens_per_s": 0.0, "kv_mb_per_s": 0.0}),
            })
        return {"model": self.model, "time": time.time(), "interval_s": self.interval_s,
                "operator": operator, "workers": workers, "history": list(self.history)}


def is_operator(scope: dict[str, Any]) -> bool:
    """Whether the request may use the operator's routes (drain, resume): the same rule as
    those routes (``server.tenancy.require_operator``)."""
    try:
        require_operator(scope, "the cluster view's drain buttons")
    except APIError:
        return False
    return True


def install_cluster_view(app: FastAPI, view: ClusterView) -> None:
    """Add ``GET /cluster`` and sample ``view`` while the app runs."""

    @app.get("/cluster")
    async def cluster(request: Request) -> dict[str, Any]:
        return view.snapshot(is_operator(request.scope))
