"""The prefill role's policy in the real worker loop, over fakes (no model, no sockets): the
bootstrap before the task, during the prefill or after the first token; pages sent chunk by
chunk; the first token to the router; aborts at every stage; a grammar compile that fails; a
bootstrap that never comes (fake clock); a refused handshake; a router that goes away. Every
case ends with every page back, and a prefilled request's pages are the scheduler's
(``SENDING_KV``) while its KV is sent."""

from __future__ import annotations

import msgspec
import pytest

from splitserve.ipc.messages import (
    AbortTask,
    FailureKind,
    KVBootstrap,
    KVFailed,
    KVKeepalive,
    KVReleased,
)
from splitserve.kv_transfer.base import layout_to_msg
from splitserve.kv_transfer.session import TransferState
from splitserve.worker.routers import CHECK_S
from tests.workers.fakes import DECODE, ROUTER, TIMEOUT_S, WEIGHTS, make_rig, next_token, task

T = TransferState
PROMPT_LEN = 10  # 3 pages of 4 tokens; chunks of 4 tokens complete a page each


def bootstrap(rig, rid: str = "r1", **changes) -> KVBootstrap:
    boot = KVBootstrap(rid=rid, dst_addr=DECODE, page_ids=[41, 42, 43],
                       layout=layout_to_msg(rig.worker.pool.layout), kv_transfer="zmq",
                       weights=WEIGHTS)
    return msgspec.structs.replace(boot, **changes)


def run_until_prefilled(rig, rid: str = "r1") -> None:
    for _ in range(20):
        rig.run()
        if rig.scheduler.sending_kv:
            return
    raise AssertionError(f"{rid} was not prefilled")


def state(rig, rid: str = "r1") -> TransferState | None:
    session = rig.worker.sessions.get(rid)
    return None if session is None else session.state


def test_bootstrap_first_then_chunks_then_the_rest() -> None:
    rig = make_rig("prefill", max_batch_tokens=4)
    t = task("r1", prompt_len=PROMPT_LEN)
    rig.worker.dispatch(t, [])
    rig.worker.dispatch(bootstrap(rig), [])
    assert rig.outbox.take(KVKeepalive, DECODE) == [KVKeepalive("r1")]  # the ack
    rig.sender.busy.add("r1")  # the backend reads the pages until the test says
    run_until_prefilled(rig)
    sends = rig.sender.sends
    # One complete page per chunk, as soon as computed; then the partial last page and the
    # first token.
    assert [(s[2], s[3]) for s in sends] == [([41], False), ([42], False), ([43], True)]
    (first,) = rig.tokens()["r1"]
    assert first.index == 0 and first.token_ids == [next_token(t.input_ids)]
    assert state(rig) is T.DRAINING
    # Drained: the pages stay the scheduler's until the backend no longer reads them.
    rig.run(3)
    assert rig.pages_used() == 3 and len(rig.scheduler.sending_kv) == 1
    rig.scheduler.check_pages()
    rig.sender.busy.clear()
    rig.run()
    assert state(rig) is None and not rig.worker.sessions
    rig.assert_no_pages_held()
    assert rig.errors() == []


def test_bootstrap_after_the_first_token() -> None:
    rig = make_rig("prefill")
    rig.worker.dispatch(task("r1", prompt_len=PROMPT_LEN), [])
    run_until_prefilled(rig)
    assert state(rig) is T.PREFILLED and rig.sender.sends == []
    assert rig.pages_used() == 3  # held in SENDING_KV, counted by the scheduler
    rig.scheduler.check_pages()
    rig.worker.dispatch(bootstrap(rig), [])
    assert [(s[2], s[3]) for s in rig.sender.sends] == [([41, 42, 43], True)]
    rig.run()
    rig.assert_no_pages_held()
    assert not rig.worker.sessions


def test_bootstrap_before_the_task() -> None:
    rig = make_rig("prefill")
    rig.worker.dispatch(bootstrap(rig), [])
    assert state(rig) is T.WAITING_FOR_TASK and rig.outbox.take(KVKeepalive) == [KVKeepalive("r1")]
    assert rig.worker.policy.held() == {}  # a bootstrap alone names no router
    rig.worker.dispatch(task("r1", prompt_len=PROMPT_LEN), [])
    assert state(rig) is T.TRANSFERRING
    rig.run()  # the whole prompt in one step; its pages sent and read at once: released
    assert [(s[2], s[3]) for s in rig.sender.sends] == [([41, 42], False), ([43], True)]
    assert "r1" in rig.tokens() and not rig.worker.sessions
    rig.assert_no_pages_held()


@pytest.mark.parametrize("stage", ["compiling", "queued", "computing", "prefilled", "draining"])
def test_abort_at_each_stage(stage: str) -> None:
    rig = make_rig("prefill", max_batch_tokens=4)
    rig.worker.dispatch(task("r1", prompt_len=PROMPT_LEN, constrained=stage == "compiling"), [])
    if stage == "computing":
        rig.run()
        assert rig.scheduler.waiting[0].kv_len == 4 and rig.pages_used() == 1
    elif stage == "prefilled":
        run_until_prefilled(rig)
        assert state(rig) is T.PREFILLED
    elif stage == "draining":
        rig.worker.dispatch(bootstrap(rig), [])
        rig.sender.busy.add("r1")
        run_until_prefilled(rig)
        assert state(rig) is T.DRAINING
    rig.worker.dispatch(AbortTask("r1"), [])
    if stage == "draining":  # every page was sent: held until the backend is done with them
        rig.run()
        assert rig.pages_used() == 3
        rig.sender.busy.clear()
    rig.run(2)
    assert "r1" in rig.sender.cancelled
    assert not rig.worker.sessions and not rig.grammars.is_pending("r1")
    assert rig.errors() == []
    rig.assert_no_pages_held()


def test_a_failed_compile_fails_the_request_and_tells_the_decode_worker() -> None:
    rig = make_rig("prefill")
    rig.worker.dispatch(task("r1", constrained=True), [])
    rig.worker.dispatch(bootstrap(rig), [])
    rig.grammars.finish("r1", error="regex: unsupported lookahead")
    rig.run()
    (err,) = rig.errors()
    assert (err.code, err.kind, err.message) == (400, "grammar", "regex: unsupported lookahead")
    (failed,) = rig.outbox.take(KVFailed, DECODE)
    assert failed.kind == FailureKind.GRAMMAR.value  # the decode worker reports it as such
    assert rig.worker.port.num_transfer_failures == 0
    assert not rig.worker.sessions
    rig.assert_no_pages_held()


def test_no_bootstrap_within_the_timeout_fails_the_request() -> None:
    rig = make_rig("prefill")
    rig.worker.dispatch(task("r1", prompt_len=PROMPT_LEN), [])
    run_until_prefilled(rig)
    rig.clock.advance(TIMEOUT_S)
    rig.run()
    assert rig.errors() == [] and rig.pages_used() == 3  # at the deadline, not past it
    rig.clock.advance(0.5)
    rig.run()
    (err,) = rig.errors()
    assert "no decode worker bootstrap within 3 s" in err.message
    assert err.kind == FailureKind.TRANSFER.value
    assert rig.worker.port.num_transfer_failures == 1
    rig.assert_no_pages_held()


def test_a_bootstrap_with_another_layout_is_refused() -> None:
    rig = make_rig("prefill")
    rig.worker.dispatch(task("r1", prompt_len=PROMPT_LEN), [])
    rig.run()
    wrong = msgspec.structs.replace(layout_to_msg(rig.worker.pool.layout), page_size=8)
    rig.worker.dispatch(bootstrap(rig, layout=wrong), [])
    (refusal,) = rig.outbox.take(KVFailed, DECODE)
    assert refusal.message.startswith("refused by prefill worker: ")
    assert "page_size: 4 here vs 8" in refusal.message
    (err,) = rig.errors()
    assert err.kind == FailureKind.TRANSFER.value and err.message == refusal.message
    rig.assert_no_pages_held()


def test_the_decode_worker_gives_up_and_asks_for_an_acknowledgement() -> None:
    rig = make_rig("prefill", max_batch_tokens=4)
    rig.worker.dispatch(task("r1", prompt_len=PROMPT_LEN), [])
    rig.worker.dispatch(bootstrap(rig), [])
    rig.run()
    rig.worker.dispatch(KVFailed("r1", "decode worker timed out", ack_addr=DECODE), [])
    rig.run()
    assert rig.outbox.take(KVReleased, DECODE) == [KVReleased("r1")]
    assert rig.errors() == []  # the decode worker told the router
    rig.run(2)
    assert not rig.worker.sessions
    rig.assert_no_pages_held()


def test_a_router_that_goes_away_loses_its_requests() -> None:
    rig = make_rig("prefill", max_batch_tokens=4)
    rig.worker.dispatch(task("r1", prompt_len=PROMPT_LEN), [])
    rig.run()
    rig.outbox.drops[ROUTER] += 1
    rig.clock.advance(CHECK_S)
    rig.run()
    (err,) = rig.errors()
    assert err.code == 503 and err.kind == FailureKind.ROUTER_GONE.value
    assert rig.worker.port.num_orphaned == 1 and not rig.worker.sessions
    rig.assert_no_pages_held()


def test_a_cached_prefix_is_the_cache_s_while_the_rest_is_sent() -> None:
    """Radix cache: the second request's prompt is matched; while its KV is sent, its own
    pages are the scheduler's (SENDING_KV) and the matched ones the cache's."""
    rig = make_rig("prefill", prefix_cache="radix")
    for rid in ("r1", "r2"):
        rig.worker.dispatch(task(rid, prompt_len=PROMPT_LEN), [])
        run_until_prefilled(rig, rid)
        (req,) = rig.scheduler.sending_kv
        rig.scheduler.check_pages()
        # Its two full pages are the cache's (cached once computed, or matched), the
        # partial third one its own.
        assert req.matched_len == 8 and rig.pages_used() == 1
        rig.worker.dispatch(bootstrap(rig, rid), [])
        rig.run()
        assert not rig.scheduler.sending_kv
    assert rig.tokens()["r2"][0].cached_len == 8
    assert rig.scheduler.cache.stats().cached_pages == 2
    rig.assert_no_pages_held()
