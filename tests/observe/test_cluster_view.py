"""The cluster view's numbers (``server.cluster_view``) and ``splitserve top``'s screen, with a
fake clock and a fake pool: interval means and p90 from the router's histograms, each worker's
rates from its heartbeat counters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from rich.console import Console

from splitserve.server.cluster_view import ClusterView, _histogram_state, _interval_stats
from splitserve.server.metrics import ServerMetrics
from splitserve.top import render, sparkline


def test_interval_mean_and_p90_from_histogram_readings() -> None:
    m = ServerMetrics()
    m.ttft.observe(30.0)  # before the interval: not counted
    before = _histogram_state(m.ttft)
    for v in [0.02] * 9 + [0.2]:
        m.ttft.observe(v)
    mean, p90 = _interval_stats(before, _histogram_state(m.ttft))
    assert mean == pytest.approx(0.038)
    assert 0.01 <= p90 <= 0.025  # the 9th of 10 lies in the (0.01, 0.025] bucket
    assert _interval_stats(before, before) == (None, None)


def test_samples_give_history_and_worker_rates() -> None:
    m = ServerMetrics()
    now = [100.0]
    w = SimpleNamespace(worker_id="decode-0", role="decode", ready=True, draining=True,
                        in_flight=2, failures=0, last_stats={"tokens_generated": 100,
                                                             "kv_bytes_received": 0})
    view = ClusterView(SimpleNamespace(workers=[w]), m, "model", clock=lambda: now[0])
    view.sample()
    now[0] += 2.0
    w.last_stats = {"tokens_generated": 160, "kv_bytes_received": 4_000_000,
                    "cache_hit_tokens": 5, "cache_prompt_tokens": 20}
    m.generation_tokens.inc(50)
    m.requests.labels("finished").inc(4)
    m.itl.observe(0.05)
    view.sample()
    doc = view.snapshot(operator=False)
    (row,) = doc["workers"]
    assert row["tokens_per_s"] == pytest.approx(30.0) and row["kv_mb_per_s"] == pytest.approx(2.0)
    assert row["cache_hit_rate"] == 0.25 and row["draining"] is True
    (point,) = doc["history"]
    assert point["tokens_per_s"] == pytest.approx(25.0)
    assert point["requests_per_s"] == pytest.approx(2.0)
    assert point["itl_mean_s"] == pytest.approx(0.05) and point["ttft_mean_s"] is None

    console = Console(record=True, width=140)
    console.print(render(doc))
    screen = console.export_text()
    assert "decode-0" in screen and "draining" in screen and "30.0" in screen


def test_sparkline_scales_to_its_maximum_and_keeps_gaps() -> None:
    assert sparkline([0.0, None, 1.0, 0.5]) == "▁ █▄"
