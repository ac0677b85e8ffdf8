"""The capacity planner's simulator (``bench/pd_sim.py``) against hand-computed timelines."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from pd_sim import ClusterShape, ServingOverhead, StepModel, simulate

# Decode: 10 ms + 1 ms per row; prefill: 20 ms + 0.1 ms per token (no context terms).
MODEL = StepModel(d0=0.010, d_row=0.001, d_ctx=0.0, p0=0.020, p_tok=0.0001, p_pair=0.0)


def test_one_request_disaggregated() -> None:
    (out,) = simulate([(0.0, 100, 3)], ClusterShape(1, 1), MODEL, MODEL)
    assert out.ttft == pytest.approx(0.030)  # 20 ms + 100 x 0.1 ms
    assert out.itls == pytest.approx([0.011, 0.011])  # two decode steps of one row
    assert out.output_tokens == 3 and out.latency == pytest.approx(0.052)


def test_one_request_colocated_and_a_mixed_step() -> None:
    (a,) = simulate([(0.0, 100, 3)], ClusterShape(num_colocated=1), MODEL, MODEL)
    assert a.ttft == pytest.approx(0.030) and a.itls == pytest.approx([0.011, 0.011])
    # b arrives while a decodes: the next step decodes a and prefills b in one pass.
    a, b = simulate([(0.0, 100, 3), (0.031, 50, 2)], ClusterShape(num_colocated=1), MODEL, MODEL)
    mixed = 0.011 + 0.005  # a's decode row plus b's 50 tokens without a second intercept
    assert a.itls[1] == pytest.approx(mixed)
    assert b.ttft == pytest.approx(0.041 + mixed - 0.031)


def test_prefill_queue_is_fcfs_under_the_token_budget() -> None:
    shape = ClusterShape(1, 1, max_batch_tokens=100)
    a, b = simulate([(0.0, 150, 1), (0.0, 50, 1)], shape, MODEL, MODEL)
    # Step 1: a's first 100 tokens; step 2: a's last 50 and b's 50.
    assert a.ttft == pytest.approx(0.030 + 0.030) and b.ttft == a.ttft
    assert a.output_tokens == b.output_tokens == 1


def test_decode_requests_go_to_the_least_loaded_worker() -> None:
    outs = simulate([(0.0, 10, 20), (0.0, 10, 20)], ClusterShape(1, 2), MODEL, MODEL)
    # Each decodes alone on its own worker: every gap is a one-row step.
    assert all(gap == pytest.approx(0.011) for o in outs for gap in o.itls[1:])


def test_serving_overhead_adds_to_requests_steps_and_tokens() -> None:
    over = ServingOverhead(request_s=0.004, step_s=0.002, token_s=0.001)
    (out,) = simulate([(0.0, 100, 3)], ClusterShape(num_colocated=1), MODEL, MODEL, over)
    # Half the request overhead to the queue, the prefill step (+ one step, one token), half
    # back; each later step is one decode row plus one step and one token of overhead.
    assert out.ttft == pytest.approx(0.002 + 0.030 + 0.003 + 0.002)
    assert out.itls == pytest.approx([0.014, 0.014])
    assert out.latency == pytest.approx(out.ttft + 0.028)


def test_closed_loop_starts_the_next_request_when_one_finishes() -> None:
    over = ServingOverhead(request_s=0.004)
    reqs = [(5.0, 100, 1), (9.0, 100, 1), (0.0, 100, 1)]  # arrival times are ignored
    a, b, c = simulate(reqs, ClusterShape(num_colocated=1), MODEL, MODEL, over, concurrency=2)
    assert a.start == b.start == 0.0
    # a's arrival starts a step alone (30 ms); b waits for it; c is sent when a's answer is
    # back (34 ms), reaches the queue 2 ms later and waits for b's step to end (62 ms).
    assert a.latency == pytest.approx(0.002 + 0.030 + 0.002)
    assert b.ttft == pytest.approx(0.062 + 0.002)
    assert c.start == pytest.approx(a.latency)
    assert c.ttft == pytest.approx(0.092 + 0.002 - 0.034)


LENGTHS = [(40 + 7 * i % 90, 32) for i in range(24)]  # (prompt, output) tokens
SHAPE = ClusterShape(num_colocated=1)


def _closed_loop_runs(truth: ServingOverhead, extra_p99_ms: float = 0.0) -> list[dict]:
    """serving.py-like closed-loop runs at c=1 and c=8, simulated with ``truth``, their p99
    ITL raised by ``extra_p99_ms`` (a tail the steps do not make)."""
    from serving_metrics import summarize

    runs = []
    for c in (1, 8):
        outs = simulate([(0.0, p, o) for p, o in LENGTHS], SHAPE, MODEL, MODEL, truth,
                        concurrency=c)
        summary = summarize(outs, max(o.start + o.latency for o in outs), {})
        summary["itl_ms"]["p99"] += extra_p99_ms
        runs.append({"load_kind": "concurrency", "load_value": c, "summary": summary})
    return runs


def test_calibrate_recovers_the_overhead_that_made_the_runs() -> None:
    from plan_pd import calibrate

    truth = ServingOverhead(request_s=0.025, step_s=0.0015, token_s=0.0004)
    runs = _closed_loop_runs(truth)
    got = calibrate(runs, LENGTHS, SHAPE, MODEL)
    assert got.step_s == pytest.approx(truth.step_s, rel=0.05, abs=1e-4)
    assert got.token_s == pytest.approx(truth.token_s, rel=0.05, abs=5e-5)
    assert got.request_s == pytest.approx(truth.request_s, rel=0.1)
    assert got.itl_tail_s == pytest.approx(0.0, abs=2e-4)  # simulated runs have no extra tail
    with pytest.raises(ValueError, match="two concurrencies"):
        calibrate(runs[:1], LENGTHS, SHAPE, MODEL)


def test_calibrate_fits_the_p99_itl_tail_and_reports_it() -> None:
    """Runs whose p99 ITL sits 9 ms above what their steps explain: the fit finds the 9 ms, and
    a simulated run with the fitted overhead reports it in p99 ITL (and only there)."""
    from plan_pd import calibrate, simulate_run

    runs = _closed_loop_runs(ServingOverhead(request_s=0.02, step_s=0.001, token_s=0.0002),
                             extra_p99_ms=9.0)
    got = calibrate(runs, LENGTHS, SHAPE, MODEL)
    assert got.itl_tail_s == pytest.approx(0.009, abs=5e-4)
    plain = simulate_run(runs[1], LENGTHS, SHAPE, MODEL, replace(got, itl_tail_s=0.0), {})
    tailed = simulate_run(runs[1], LENGTHS, SHAPE, MODEL, got, {})
    assert tailed["itl_ms"]["p99"] == pytest.approx(plain["itl_ms"]["p99"] + 9.0, abs=0.5)
    assert tailed["itl_ms"]["p50"] == plain["itl_ms"]["p50"]


def test_workers_sharing_cores_slow_each_other_down() -> None:
    # Two prefill workers on one core: the second step to start, while the first runs, gets
    # half the core (the share is taken when a step starts).
    a, b = simulate([(0.0, 100, 1), (0.0, 100, 1)], ClusterShape(2, 1, cores=1), MODEL, MODEL)
    assert a.ttft == pytest.approx(0.030) and b.ttft == pytest.approx(0.060)
    a, b = simulate([(0.0, 100, 1), (0.0, 100, 1)], ClusterShape(2, 1), MODEL, MODEL)
    assert a.ttft == b.ttft == pytest.approx(0.030)  # a core each
