"""The timing breakdown (``observe.timing``): its stages partition the time from arrival to the
last boundary, whichever boundaries were reached, whatever the clocks."""

from __future__ import annotations

import pytest

from splitserve.ipc.messages import StageStamps
from splitserve.observe.timing import RequestTiming, server_timing_header


def _disagg() -> RequestTiming:
    t = RequestTiming(arrival=100.0, sent=100.01, first=100.30, last=101.00)
    t.merge(StageStamps(received=100.02, scheduled=100.05, first_token=100.25))
    t.merge(StageStamps(decode_received=100.02, kv_ready=100.27, first_step=100.32,
                        last=100.99, steps=20))
    return t


def test_stages_of_a_disaggregated_request_in_order() -> None:
    stages = _disagg().stages(end=101.02)
    assert list(stages) == ["server", "queue", "prefill", "transfer", "decode", "deliver",
                            "respond"]
    expected = [0.01, 0.04, 0.20, 0.02, 0.72, 0.01, 0.02]
    assert list(stages.values()) == pytest.approx(expected)
    assert sum(stages.values()) == pytest.approx(1.02)


def test_a_missing_boundary_merges_its_stage_into_the_next() -> None:
    # A one-token answer: the decode worker's stamps never reach the router.
    t = RequestTiming(arrival=10.0, sent=10.1, first=10.6, last=10.6)
    t.merge(StageStamps(received=10.2, scheduled=10.3, first_token=10.5))
    stages = t.stages()
    assert list(stages) == ["server", "queue", "prefill", "deliver"]
    assert sum(stages.values()) == pytest.approx(0.6)


def test_clocks_that_disagree_give_no_negative_stage() -> None:
    t = _disagg()
    t.worker.kv_ready = 100.20  # the decode host's clock is behind: before the first token
    stages = t.stages(end=101.02)
    assert min(stages.values()) >= 0
    assert stages["transfer"] == 0
    assert sum(stages.values()) == pytest.approx(1.02)


def test_a_later_output_wins_and_zero_never_overwrites() -> None:
    t = RequestTiming(arrival=1.0)
    t.merge(StageStamps(received=2.0, first_token=3.0))
    t.merge(StageStamps(last=4.0, steps=3))
    assert (t.worker.received, t.worker.first_token, t.worker.last, t.worker.steps) == \
        (2.0, 3.0, 4.0, 3)


def test_summary_and_header() -> None:
    t = _disagg()
    t.prepare = [("template", 100.001, 100.002), ("tokenize", 100.002, 100.004)]
    s = t.summary(end=101.02)
    assert s["total_ms"] == pytest.approx(1020.0)
    assert s["ttft_ms"] == pytest.approx(300.0)
    assert s["decode_steps"] == 20
    assert s["prepare_ms"] == {"template": pytest.approx(1.0), "tokenize": pytest.approx(2.0)}
    header = server_timing_header(t.stages(101.02))
    assert header.startswith("server;dur=10.000, queue;dur=40.000, prefill;dur=200.000")


def test_fork_keeps_arrival_and_preparation_only() -> None:
    t = _disagg()
    t.prepare = [("tokenize", 100.0, 100.001)]
    f = t.fork()
    assert (f.arrival, f.prepare, f.sent, f.worker.steps) == (100.0, t.prepare, 0.0, 0)
    assert f.prepare is not t.prepare
