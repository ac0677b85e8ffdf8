"""The colocated role's policy in the real worker loop, over fakes (no model, no sockets): a task
runs to its end, a constrained one after its compile, a failed compile fails only its request,
aborts at every stage and a router that goes away free every page."""

from __future__ import annotations

import pytest

from splitserve.ipc.messages import AbortTask, FailureKind, RouterBeat
from splitserve.worker.routers import CHECK_S
from tests.workers.fakes import (
    CONTEXT_LEN,
    ROUTER,
    expected_output,
    joined,
    make_rig,
    task,
)


def test_a_task_runs_to_its_end() -> None:
    rig = make_rig("colocated", max_batch_tokens=4)
    t = task("r1", prompt_len=10, max_new=5)
    rig.worker.dispatch(t, [])
    rig.run_until_idle()
    outs = rig.tokens()["r1"]
    assert joined(outs) == expected_output(t.input_ids, 5)
    assert outs[-1].finish_reason == "length" and outs[0].prompt_len == 10
    assert rig.errors() == []
    rig.assert_no_pages_held()


def test_a_constrained_task_waits_for_its_compile() -> None:
    rig = make_rig("colocated")
    rig.worker.dispatch(task("r1", constrained=True), [])
    rig.run(3)
    assert rig.runner.num_steps == 0 and rig.pages_used() == 0
    assert rig.worker.policy.held() == {"r1": ROUTER}  # compiling, still the router's
    rig.grammars.finish("r1")
    rig.run_until_idle()
    outs = rig.tokens()["r1"]
    assert joined(outs) == expected_output(task("r1").input_ids, 4)
    rig.assert_no_pages_held()


def test_a_failed_compile_fails_only_its_request() -> None:
    rig = make_rig("colocated")
    rig.worker.dispatch(task("bad", constrained=True), [])
    rig.worker.dispatch(task("good", start=300), [])
    rig.grammars.finish("bad", error="regex: unsupported lookahead")
    rig.run_until_idle()
    (err,) = rig.errors()
    assert (err.rid, err.code, err.kind) == ("bad", 400, FailureKind.GRAMMAR.value)
    assert err.message == "regex: unsupported lookahead"
    assert list(rig.tokens()) == ["good"]
    assert rig.worker.port.num_failed == 1 and rig.worker.port.num_transfer_failures == 0
    rig.assert_no_pages_held()


@pytest.mark.parametrize("stage", ["compiling", "prefilling", "decoding"])
def test_abort_at_each_stage(stage: str) -> None:
    rig = make_rig("colocated", max_batch_tokens=4)
    rig.worker.dispatch(task("r1", prompt_len=10, max_new=20, constrained=True), [])
    if stage != "compiling":
        rig.grammars.finish("r1")
        rig.run({"prefilling": 1, "decoding": 5}[stage])
    if stage == "prefilling":  # one chunk of 4 of the 10 prompt tokens computed
        assert rig.scheduler.waiting[0].kv_len == 4 and rig.pages_used() > 0
    if stage == "decoding":
        assert rig.scheduler.running and rig.pages_used() > 0
    rig.tokens()
    rig.worker.dispatch(AbortTask("r1"), [])
    rig.run(3)
    assert rig.tokens() == {} and rig.errors() == []
    assert not rig.grammars.is_pending("r1") and rig.worker.policy.held() == {}
    rig.assert_no_pages_held()


def test_abort_of_a_queued_request() -> None:
    """Scheduled, not stepped yet: it leaves the waiting queue."""
    rig = make_rig("colocated")
    rig.worker.dispatch(task("r1"), [])
    assert [r.rid for r in rig.scheduler.waiting] == ["r1"]
    rig.worker.dispatch(AbortTask("r1"), [])
    rig.run(2)
    assert rig.tokens() == {} and rig.runner.num_steps == 0
    rig.assert_no_pages_held()


@pytest.mark.parametrize("prompt_len,why", [
    (0, "prompt is empty"),
    (CONTEXT_LEN, f"exceeds the model context of {CONTEXT_LEN}"),
    (63 * 4, "does not fit the KV pool (252 tokens)"),
])
def test_a_task_that_can_never_run_is_refused(prompt_len: int, why: str) -> None:
    rig = make_rig("colocated")
    rig.worker.dispatch(task("r1", prompt_len=prompt_len), [])
    (err,) = rig.errors()
    assert err.code == 400 and why in err.message and err.kind == FailureKind.INVALID.value
    rig.assert_no_pages_held()


def test_a_router_whose_link_drops_loses_its_requests() -> None:
    rig = make_rig("colocated")
    rig.worker.dispatch(task("r1", max_new=100), [])
    rig.worker.dispatch(task("r2", max_new=100, reply_addr="tcp://other-router"), [])
    rig.run(3)
    assert rig.pages_used() > 0
    rig.outbox.drops[ROUTER] += 1  # the router process exited
    rig.clock.advance(CHECK_S)
    rig.run()
    err = next(e for e in rig.errors() if e.rid == "r1")
    assert err.code == 503 and err.kind == FailureKind.ROUTER_GONE.value
    assert "closed its link" in err.message
    assert rig.worker.port.num_orphaned == 1
    assert [r.rid for r in rig.scheduler.running] == ["r2"]  # the other router's goes on
    rig.worker.dispatch(AbortTask("r2"), [])
    rig.assert_no_pages_held()


def test_a_silent_router_loses_its_requests_after_its_bound() -> None:
    rig = make_rig("colocated")
    rig.worker.dispatch(RouterBeat(ROUTER, dead_after_s=1.0), [])
    rig.worker.dispatch(task("r1", max_new=400), [])
    for _ in range(4):  # 1 s of beats, in steps shorter than a stall
        rig.clock.advance(CHECK_S)
        rig.worker.dispatch(RouterBeat(ROUTER, dead_after_s=1.0), [])
        rig.run()
    assert rig.errors() == [] and rig.scheduler.running
    for _ in range(5):  # then 1.25 s of silence
        rig.clock.advance(CHECK_S)
        rig.run()
    (err,) = rig.errors()
    assert err.code == 503 and "sent nothing for 1 s" in err.message
    rig.assert_no_pages_held()


def test_a_repeated_prompt_is_served_from_the_prefix_cache() -> None:
    """With the radix cache, what stays used after the requests is the cache's alone."""
    rig = make_rig("colocated", prefix_cache="radix")
    for rid in ("r1", "r2"):
        rig.worker.dispatch(task(rid, prompt_len=13, max_new=3), [])
        rig.run_until_idle()
    outs = rig.tokens()
    assert outs["r2"][0].cached_len == 12 and outs["r1"][0].cached_len == 0
    assert joined(outs["r2"]) == joined(outs["r1"])
    assert rig.scheduler.cache.stats().cached_pages > 0
    rig.assert_no_pages_held()
