"""The decode role's policy in the real worker loop, over fakes (no model, no sockets): a task is
admitted by the scheduler (pages reserved, bootstrap sent), its KV arrives, its first token is
replayed and it decodes; admission in arrival order while the pool is full; aborts at every
stage; a one-sided transfer's fence; a grammar that fails to compile or refuses the first
token; a transfer that times out (fake clock); a router that goes silent. Every case ends with
every page back; while a request's KV is coming its pages are the scheduler's."""

from __future__ import annotations

import pytest

from splitserve.ipc.messages import (
    AbortTask,
    FailureKind,
    KVBootstrap,
    KVFailed,
    KVKeepalive,
    KVPages,
    KVQueued,
    KVReleased,
    RouterBeat,
)
from splitserve.kv_transfer.session import TransferState
from splitserve.worker.routers import CHECK_S
from tests.workers.fakes import (
    DECODE,
    PREFILL,
    ROUTER,
    TIMEOUT_S,
    FakeGrammar,
    expected_output,
    joined,
    make_rig,
    next_token,
    task,
)

T = TransferState
PROMPT_LEN = 10  # 3 pages of 4 tokens


def dtask(rid: str = "r1", prompt_len: int = PROMPT_LEN, max_new: int = 5, **kw):
    return task(rid, prompt_len, max_new, prefill_addr=PREFILL, **kw)


def pages(rid: str, page_ids: list[int], *, last: bool = False, first_token: int = -1,
          finished: bool = False) -> KVPages:
    return KVPages(rid=rid, page_ids=page_ids, num_frames=0, last=last, first_token=first_token,
                   first_logprob=-0.25, finished=finished)


def bootstraps(rig) -> dict[str, list[int]]:
    """The bootstraps sent since the last call: rid -> the pages it names."""
    return {b.rid: b.page_ids for b in rig.outbox.take(KVBootstrap, PREFILL)}


def deliver(rig, t, first_token: int | None = None) -> None:
    """The prefill worker's side of ``t``: its pages in two messages, then the first token."""
    (page_ids,) = bootstraps(rig).values()
    first = next_token(t.input_ids) if first_token is None else first_token
    rig.worker.dispatch(pages(t.rid, page_ids[:2]), [])
    rig.worker.dispatch(pages(t.rid, page_ids[2:], last=True, first_token=first), [])


def state(rig, rid: str = "r1") -> TransferState | None:
    session = rig.worker.sessions.get(rid)
    return None if session is None else session.state


def test_task_bootstrap_pages_then_decoding() -> None:
    rig = make_rig("decode")
    t = dtask(max_new=6)
    rig.worker.dispatch(t, [])
    # Admitted by the scheduler at once: the prompt's pages reserved, the bootstrap sent.
    (boot,) = rig.outbox.take(KVBootstrap, PREFILL)
    assert boot.dst_addr == DECODE and len(boot.page_ids) == 3
    (req,) = rig.scheduler.receiving_kv
    assert req.page_ids == boot.page_ids and rig.pages_used() == 3
    rig.scheduler.check_pages()
    rig.worker.dispatch(pages("r1", boot.page_ids[:2]), [])
    first = next_token(t.input_ids)
    rig.worker.dispatch(pages("r1", boot.page_ids[2:], last=True, first_token=first), [])
    assert [h.page_ids for h in rig.receiver.installed] == [boot.page_ids[:2], boot.page_ids[2:]]
    assert state(rig) is None and rig.scheduler.running == [req]
    rig.run_until_idle()
    outs = rig.tokens()["r1"]
    assert outs[0].index == 1  # the first token went to the router from the prefill worker
    assert [first] + joined(outs, 1) == expected_output(t.input_ids, 6)
    assert outs[-1].finish_reason == "length"
    rig.assert_no_pages_held()
    assert rig.errors() == []


def test_admission_in_arrival_order_while_the_pool_is_full() -> None:
    rig = make_rig("decode", num_pages=8)  # 7 usable pages
    rig.worker.dispatch(dtask("r1"), [])  # 3 pages
    rig.worker.dispatch(dtask("r2"), [])  # 3 pages
    rig.worker.dispatch(dtask("r3"), [])  # 3 pages: does not fit
    rig.worker.dispatch(dtask("r4", prompt_len=3), [])  # 1 page: fits, but queues behind r3
    assert list(bootstraps(rig)) == ["r1", "r2"]
    assert [r.rid for r in rig.scheduler.waiting_for_kv] == ["r3", "r4"]
    assert state(rig, "r3") is T.QUEUED and state(rig, "r4") is T.QUEUED
    # Waiting for pages is not a stall: the prefill worker hears so every third of the timeout.
    rig.clock.advance(TIMEOUT_S / 3 + 0.5)
    rig.run()
    assert [q.rid for q in rig.outbox.take(KVQueued, PREFILL)] == ["r3", "r4"]
    rig.worker.dispatch(AbortTask("r1"), [])  # its pages come back: r3 then r4, in order
    assert list(bootstraps(rig)) == ["r3", "r4"]
    for rid in ("r2", "r3", "r4"):
        rig.worker.dispatch(AbortTask(rid), [])
    rig.assert_no_pages_held()
    assert not rig.worker.sessions and rig.errors() == []


@pytest.mark.parametrize("stage", ["queued", "receiving", "compiling", "decoding"])
def test_abort_at_each_stage(stage: str) -> None:
    rig = make_rig("decode", num_pages=6 if stage == "queued" else 64)  # 5 usable
    if stage == "queued":
        rig.worker.dispatch(dtask("r0"), [])  # holds 3 pages
        bootstraps(rig)
    t = dtask(max_new=50, constrained=stage == "compiling")
    rig.worker.dispatch(t, [])
    if stage == "queued":
        assert state(rig) is T.QUEUED and rig.pages_used() == 3
    elif stage == "receiving":
        (page_ids,) = bootstraps(rig).values()
        rig.worker.dispatch(pages("r1", page_ids[:2]), [])
        assert state(rig) is T.WAITING_FOR_PAGES and rig.pages_used() == 3
    elif stage == "compiling":  # the KV is in, the grammar still compiles
        deliver(rig, t)
        assert state(rig) is T.KV_READY and rig.pages_used() == 3
    else:
        deliver(rig, t)
        rig.run(3)
        assert rig.scheduler.running and rig.tokens()
    rig.worker.dispatch(AbortTask("r1"), [])
    rig.run(2)
    assert rig.tokens() == {} and rig.errors() == []
    assert state(rig) is None and not rig.grammars.is_pending("r1")
    if stage == "queued":
        assert bootstraps(rig) == {}  # it never got pages
        rig.worker.dispatch(AbortTask("r0"), [])
    assert not rig.worker.sessions
    rig.assert_no_pages_held()


def test_a_one_sided_transfer_is_fenced_until_the_prefill_worker_acknowledges() -> None:
    rig = make_rig("decode", one_sided=True)
    rig.worker.dispatch(dtask(), [])
    (page_ids,) = bootstraps(rig).values()
    rig.worker.dispatch(pages("r1", page_ids[:2]), [])
    rig.worker.dispatch(AbortTask("r1"), [])
    (fence,) = rig.outbox.take(KVFailed, PREFILL)
    assert fence.ack_addr == DECODE
    rig.clock.advance(TIMEOUT_S / 2)
    rig.run(3)
    # The prefill worker may still write them: the scheduler holds them (receiving_kv).
    assert state(rig) is T.FENCED and rig.pages_used() == 3
    rig.scheduler.check_pages()
    assert rig.worker.policy.held() == {}  # no longer the router's
    rig.worker.dispatch(KVReleased("r1"), [])
    rig.assert_no_pages_held()
    assert not rig.worker.sessions


def test_a_failed_compile_fails_the_request_and_tells_the_prefill_worker() -> None:
    rig = make_rig("decode")
    rig.worker.dispatch(dtask(constrained=True), [])
    (page_ids,) = bootstraps(rig).values()
    rig.worker.dispatch(pages("r1", page_ids[:2]), [])
    rig.grammars.finish("r1", error="regex: unsupported lookahead")
    rig.run()
    (err,) = rig.errors()
    assert (err.code, err.kind) == (400, FailureKind.GRAMMAR.value)
    assert [m.message for m in rig.outbox.take(KVFailed, PREFILL)] == [
        "regex: unsupported lookahead"]
    assert rig.worker.port.num_transfer_failures == 0
    rig.assert_no_pages_held()


def test_a_grammar_that_refuses_the_first_token_fails_the_request() -> None:
    rig = make_rig("decode")
    t = dtask(constrained=True)
    rig.worker.dispatch(t, [])
    first = next_token(t.input_ids)
    rig.grammars.finish("r1", grammar=FakeGrammar(refuse=frozenset({first})))
    rig.run()
    deliver(rig, t)
    (err,) = rig.errors()
    assert err.message == f"grammar refused first token {first}" and err.code == 500
    assert err.kind == FailureKind.GRAMMAR.value
    rig.assert_no_pages_held()


def test_the_first_token_is_replayed_then_the_grammar_jumps_forward() -> None:
    """The KV arrives before the compile ends: the request waits (KV_READY, pages held), then
    replays the prefill worker's token into its grammar, whose forced tokens are appended
    unsampled and sent with the next step's."""
    rig = make_rig("decode")
    t = dtask(max_new=6, constrained=True)
    rig.worker.dispatch(t, [])
    deliver(rig, t)
    assert state(rig) is T.KV_READY and not rig.scheduler.running
    grammar = FakeGrammar(forced=[55, 56])
    rig.grammars.finish("r1", grammar=grammar)
    rig.run_until_idle()
    first = next_token(t.input_ids)
    assert grammar.accepted[0] == first
    outs = rig.tokens()["r1"]
    got = [first] + joined(outs, 1)
    assert got[:3] == [first, 55, 56]
    assert got[3:] == expected_output(t.input_ids + [first, 55, 56], 3)
    rig.assert_no_pages_held()


def test_a_first_token_that_ended_the_request_frees_its_pages() -> None:
    rig = make_rig("decode")
    t = dtask(max_new=1)
    rig.worker.dispatch(t, [])
    (page_ids,) = bootstraps(rig).values()
    rig.worker.dispatch(pages("r1", page_ids, last=True, first_token=7, finished=True), [])
    rig.run(2)
    assert rig.tokens() == {} and rig.errors() == []  # the prefill worker reported it
    rig.assert_no_pages_held()


def test_silence_from_the_prefill_worker_times_the_transfer_out() -> None:
    rig = make_rig("decode")
    rig.worker.dispatch(dtask(), [])
    assert list(bootstraps(rig)) == ["r1"]
    rig.clock.advance(TIMEOUT_S - 0.5)
    rig.worker.dispatch(KVKeepalive("r1"), [])  # alive: the deadline restarts
    rig.clock.advance(TIMEOUT_S - 0.5)
    rig.run()
    assert rig.errors() == [] and rig.pages_used() == 3
    rig.clock.advance(1.0)
    rig.run()
    (err,) = rig.errors()
    assert err.code == 504 and "timed out receiving KV pages after 3 s" in err.message
    assert err.kind == FailureKind.TRANSFER.value
    assert [m.message for m in rig.outbox.take(KVFailed, PREFILL)] == ["decode worker timed out"]
    assert rig.worker.port.num_transfer_failures == 1
    rig.assert_no_pages_held()


@pytest.mark.parametrize("kind,transfer", [("transfer", 1), ("grammar", 0), ("later-kind", 1)])
def test_a_kv_failed_from_the_prefill_worker_is_counted_by_its_kind(kind, transfer) -> None:
    rig = make_rig("decode")
    rig.worker.dispatch(dtask(), [])
    rig.worker.dispatch(KVFailed("r1", "it failed there", kind=kind), [])
    (err,) = rig.errors()
    assert err.message == "it failed there"
    assert rig.worker.port.num_transfer_failures == transfer
    rig.assert_no_pages_held()


def test_a_silent_router_loses_its_requests() -> None:
    rig = make_rig("decode")
    rig.worker.dispatch(RouterBeat(ROUTER, dead_after_s=1.0), [])
    t = dtask(max_new=400)
    rig.worker.dispatch(t, [])
    deliver(rig, t)
    for _ in range(6):  # 1.5 s without a beat, in steps shorter than a stall
        rig.clock.advance(CHECK_S)
        rig.run()
    (err,) = rig.errors()
    assert err.code == 503 and err.kind == FailureKind.ROUTER_GONE.value
    assert rig.worker.port.num_orphaned == 1
    rig.assert_no_pages_held()


def test_retracted_requests_are_prefilled_again_here() -> None:
    """Two running requests outgrow a small pool: one is retracted and recomputed locally over
    prompt + output; both end with the fake model's tokens."""
    rig = make_rig("decode", num_pages=10)  # 9 usable pages
    ts = [dtask("r1", prompt_len=8, max_new=12), dtask("r2", prompt_len=8, max_new=12,
                                                       start=300)]
    for t in ts:
        rig.worker.dispatch(t, [])
    boots = bootstraps(rig)
    for t in ts:
        first = next_token(t.input_ids)
        rig.worker.dispatch(pages(t.rid, boots[t.rid], last=True, first_token=first), [])
    rig.run_until_idle()
    assert rig.scheduler.num_retracted > 0
    outs = rig.tokens()
    for t in ts:
        first = next_token(t.input_ids)
        assert [first] + joined(outs[t.rid], 1) == expected_output(t.input_ids, 12)
    rig.assert_no_pages_held()


def test_a_task_a_decode_worker_cannot_take_is_refused() -> None:
    rig = make_rig("decode")
    rig.worker.dispatch(task("r1"), [])  # no prefill worker named
    rig.worker.dispatch(dtask("r2"), [])
    rig.worker.dispatch(dtask("r2"), [])  # a rid in use
    errs = rig.errors()
    assert [(e.rid, e.code, e.kind) for e in errs] == [("r1", 400, "invalid"),
                                                       ("r2", 400, "invalid")]
    assert "needs the task's prefill worker" in errs[0].message
    assert "request id 'r2' is in use" in errs[1].message
    rig.worker.dispatch(AbortTask("r2"), [])
    rig.assert_no_pages_held()

