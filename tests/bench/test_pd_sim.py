"""The capacity planner's simulator (``bench/pd_sim.py``) against hand-computed timelines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from pd_sim import ClusterShape, StepModel, simulate

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
