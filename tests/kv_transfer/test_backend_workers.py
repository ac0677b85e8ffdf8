"""Prefill and decode workers driven in-process with each KV transfer backend: chunk-by-chunk
sends give the colocated worker's tokens, a backend mismatch is refused naming both, a sender
that dies mid-transfer makes the receiver time out and free every page, and shared-memory
segments are gone afterwards."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from splitserve.ipc.messages import (
    GenerateTask,
    KVFailed,
    RequestError,
    SamplingParams,
)
from splitserve.ipc.sockets import Inbox, free_tcp_addr
from splitserve.kv_transfer.session import TransferState
from splitserve.kv_transfer.shm_backend import PREFIX
from tests.kv_transfer.session_fakes import FakeClock
from tests.kv_transfer.workers import (
    BACKENDS,
    PROMPT,
    finished,
    make_worker,
    run_until,
    segments,
    task,
    tokens,
)


@pytest.fixture(scope="module")
def colocated_tokens(model_path: Path) -> list[int]:
    c = zmq.Context()
    server = Inbox(c, free_tcp_addr())
    worker = make_worker(model_path, "colocated", server.addr, "zmq")
    worker.dispatch(task(server, None), [])
    got = run_until([worker], server, finished)
    server.close()
    c.destroy(linger=0)
    return tokens(got)


def _one_request(ctx, model_path: Path, backend: str):
    """A prefill and a decode worker over ``backend`` serving one request to its end: ``(server
    inbox, prefill, decode, the messages the server got)``."""
    server = Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, backend)
    decode = make_worker(model_path, "decode", server.addr, backend)
    t = task(server, None)
    prefill.dispatch(t, [])
    decode.dispatch(msgspec.structs.replace(t, prefill_addr=prefill.config.addr), [])
    return server, prefill, decode, run_until([prefill, decode], server, finished)


def _drain_and_close(server, prefill, decode) -> None:
    """Let the prefill worker finish sending, check both pools are empty, close the backends."""
    run_until([prefill, decode], server,
              lambda _: not prefill.sessions.by_state(TransferState.DRAINING), timeout_s=10)
    assert prefill.pool.allocator.num_used == 0 and decode.pool.allocator.num_used == 0
    decode.receiver.close()
    prefill.sender.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_transfer_equals_colocated(ctx, model_path, backend, colocated_tokens) -> None:
    server, prefill, decode, got = _one_request(ctx, model_path, backend)
    assert not any(isinstance(m, RequestError) for m in got), got
    assert tokens(got) == colocated_tokens
    # Overlap: pages went out in several messages (chunks of 32 tokens over 16-token pages).
    assert prefill.sender.metrics.messages_sent >= 3
    assert decode.receiver.metrics.pages_received == -(-len(PROMPT) // 16)
    stats = decode.stats()
    assert stats.kv_transfer == backend and stats.kv_bytes_received > 0 and stats.kv_gbps > 0
    assert sum(stats.kv_latency_counts) == stats.kv_messages_received
    _drain_and_close(server, prefill, decode)


def _refused_handshake(ctx, model_path, prefill_kw: dict, decode_kw: dict):
    """One request between a prefill and a decode worker built with these ``make_worker``
    keywords, whose handshake is refused. Returns ``(prefill, decode, error messages)`` once
    both errors arrived and every page of both pools is back (one-sided backends: after the
    prefill worker's acknowledgement, which it sends though it refused the transfer)."""
    server = Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, **prefill_kw)
    decode = make_worker(model_path, "decode", server.addr, **decode_kw)
    t = task(server, prefill.config.addr)
    prefill.dispatch(GenerateTask(rid="r1", input_ids=PROMPT, reply_addr=server.addr,
                                  sampling=t.sampling), [])
    decode.dispatch(t, [])
    got = run_until([prefill, decode], server,
                    lambda g: sum(isinstance(m, RequestError) for m in g) >= 2)
    run_until([prefill, decode], server,
              lambda _: decode.pool.allocator.num_used == 0 == prefill.pool.allocator.num_used)
    return prefill, decode, [m.message for m in got if isinstance(m, RequestError)]


def test_backend_mismatch_refused_naming_both(ctx, model_path) -> None:
    _, decode, msgs = _refused_handshake(
        ctx, model_path, {"kv_transfer": "zmq"}, {"kv_transfer": "shm"}
    )
    assert any("'zmq' here vs 'shm' on the decode worker" in m for m in msgs), msgs
    decode.receiver.close()


def test_weight_quantization_mismatch_refused_naming_both(ctx, model_path) -> None:
    """int8 weights on the prefill side, unquantized on the decode side: same KV layout, but
    the prompt's KV would come from other weights, so the handshake refuses it."""
    prefill, decode, msgs = _refused_handshake(
        ctx, model_path, {"kv_transfer": "zmq", "quantization": "int8"},
        {"kv_transfer": "zmq"},
    )
    assert any("quantization: int8 here vs none on the decode worker" in m for m in msgs), msgs
    assert not any("KV layout" in m for m in msgs), msgs
    assert decode.receiver.metrics.messages_received == 0
    assert prefill.sender.metrics.messages_sent == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_dies_mid_transfer(ctx, model_path, backend) -> None:
    """The prefill worker sends its first chunks, then stops for good: the decode worker times
    out, frees every page (one-sided backends too: the link to the prefill worker dropped, so
    nobody can write into them any more) and the request ends with an error."""
    before = segments()
    server = Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, backend)
    decode = make_worker(model_path, "decode", server.addr, backend, transfer_timeout_s=2.0)
    # The decode worker's deadlines read a fake clock, moved only once the prefill worker is
    # gone: however slow the machine, the transfer cannot time out before that, and times out
    # once 2 s have passed on it (no wall-clock window).
    clock = FakeClock(decode.now())
    decode.clock = clock
    assert (len(segments() - before) == 1) == (backend == "shm")
    long_prompt = list(range(100, 400))  # 10 chunks of 32 tokens; 19 of the 21 pages
    sampling = SamplingParams(max_new_tokens=4, temperature=0)
    prefill.dispatch(GenerateTask(rid="r1", input_ids=long_prompt, reply_addr=server.addr,
                                  sampling=sampling), [])
    decode.dispatch(GenerateTask(rid="r1", input_ids=long_prompt, reply_addr=server.addr,
                                 sampling=sampling, prefill_addr=prefill.config.addr), [])
    # Run the prefill worker until it has shipped an early chunk, then it "dies".
    deadline = time.monotonic() + 60
    while prefill.sender.metrics.messages_sent == 0 and time.monotonic() < deadline:
        prefill.run_once(idle_wait_ms=2)
        prefill.sender.poll()
    assert prefill.sender.metrics.messages_sent >= 1
    assert prefill.sessions.get("r1").state is TransferState.TRANSFERRING  # not prefilled yet
    # Let the backend finish what it started (the prefill worker computes nothing more): until
    # the decode worker has installed a chunk, not for a guessed time.
    while decode.receiver.metrics.messages_received == 0 and time.monotonic() < deadline:
        prefill.sender.poll()
        decode.run_once(idle_wait_ms=2)
    prefill.sender.poll()
    prefill.sender.close()
    prefill.inbox.close()  # the prefill worker is gone
    prefill.outbox.close()
    decode.run_once(idle_wait_ms=2)
    assert decode.sessions.get("r1") is not None  # not timed out: no time has passed
    for _ in range(25):  # 2.5 s on the decode worker's clock
        clock.t += 0.1
        decode.run_once(idle_wait_ms=2)
    got = run_until([decode], server, lambda g: any(isinstance(m, RequestError) for m in g))
    assert decode.receiver.metrics.messages_received >= 1  # the early chunk(s) were installed
    err = next(m for m in got if isinstance(m, RequestError))
    assert err.code == 504 and "timed out receiving KV pages" in err.message
    run_until([decode], server, lambda _: decode.pool.allocator.num_used == 0)
    decode.receiver.close()
    assert segments() <= before


def test_failed_sends_notify_decode(ctx, model_path) -> None:
    """A bootstrap naming an unusable shm segment: the prefill worker fails the request and tells
    the decode worker, which frees its reservation."""
    server, decode_inbox = Inbox(ctx, free_tcp_addr()), Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, "shm")
    from splitserve.ipc.messages import KVBootstrap
    from splitserve.kv_transfer.base import layout_to_msg

    prefill.dispatch(GenerateTask(rid="r1", input_ids=PROMPT, reply_addr=server.addr,
                                  sampling=SamplingParams(max_new_tokens=4, temperature=0)), [])
    prefill.dispatch(KVBootstrap(rid="r1", dst_addr=decode_inbox.addr, page_ids=list(range(1, 7)),
                                 layout=layout_to_msg(prefill.pool.layout), kv_transfer="shm",
                                 weights=prefill.weights,
                                 endpoint={"shm_name": PREFIX + "0-missing", "num_pages": "8"}), [])
    got = run_until([prefill], decode_inbox, lambda g: any(isinstance(m, KVFailed) for m in g))
    assert "cannot map shm segment" in next(m for m in got if isinstance(m, KVFailed)).message
    assert prefill.pool.allocator.num_used == 0 and not prefill.sessions


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_mismatch_refused_at_handshake(ctx, model_path, backend) -> None:
    """Page size 16 on the prefill side, 32 on the decode side: the prefill worker refuses the
    bootstrap naming both values, nothing is written, the request fails on both sides and every
    page comes back (one-sided backends: after the prefill worker's acknowledgement)."""
    prefill, decode, msgs = _refused_handshake(
        ctx, model_path, {"kv_transfer": backend, "page_size": 16},
        {"kv_transfer": backend, "page_size": 32},
    )
    assert any("page_size: 16 here vs 32" in m for m in msgs), msgs
    assert decode.receiver.metrics.messages_received == 0
    assert prefill.sender.metrics.messages_sent == 0
    decode.receiver.close()
    prefill.sender.close()


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="NIXL not installed")
def test_nixl_over_tcp_equals_colocated(ctx, model_path, colocated_tokens, monkeypatch) -> None:
    """UCX restricted to loopback TCP (by default it writes with cma on one host): the receiver's
    progress thread moves the data; tokens equal the colocated worker's."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    server, prefill, decode, got = _one_request(ctx, model_path, "nixl")
    assert not any(isinstance(m, RequestError) for m in got), got
    assert tokens(got) == colocated_tokens
    assert decode.receiver.metrics.pages_received == -(-len(PROMPT) // 16)
    _drain_and_close(server, prefill, decode)


def test_a_step_longer_than_the_timeout_keeps_the_transfer(ctx, model_path,
                                                           colocated_tokens) -> None:
    """One prefill step outlasts the decode worker's transfer timeout (its fake clock moves two
    timeouts while the step is held): the prefill worker's keepalives go out during the step
    (``worker.step_keepalive``), so the transfer lives on and the tokens equal colocated. Before,
    keepalives went out only between steps and such a request failed with a 504."""
    server = Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, "zmq")
    decode = make_worker(model_path, "decode", server.addr, "zmq", transfer_timeout_s=1.0)
    clock = FakeClock(decode.now())
    decode.clock = clock
    prefill.step_keepalive.interval_s = 0.02  # wall clock: the thread's
    t = task(server, None)
    decode.dispatch(msgspec.structs.replace(t, prefill_addr=prefill.config.addr), [])
    while decode.sessions.get("r1").state is not TransferState.WAITING_FOR_PAGES:
        decode.run_once(idle_wait_ms=2)  # pages reserved, bootstrap sent
    held, release = threading.Event(), threading.Event()
    step = prefill.core.step

    def held_step():
        s = prefill.sessions.get("r1")
        if s is not None and s.state is TransferState.TRANSFERRING and not held.is_set():
            held.set()
            release.wait(120)
        return step()

    prefill.core.step = held_step
    prefill.dispatch(t, [])

    def run_prefill() -> None:
        while not held.is_set() and not release.is_set():
            prefill.run_once(idle_wait_ms=2)

    runner = threading.Thread(target=run_prefill, daemon=True)
    runner.start()
    try:
        assert held.wait(60), "no step ran with the transfer bootstrapped"
        session = decode.sessions.get("r1")
        for _ in range(4):  # 2 s on the decode worker's clock, twice its timeout
            clock.advance(0.5)
            deadline = time.monotonic() + 20
            while session.deadline < clock.t + 1.0 and time.monotonic() < deadline:
                decode.run_once(idle_wait_ms=5)  # until a keepalive restarted the deadline
            assert decode.sessions.get("r1") is session, "the transfer timed out mid-step"
            assert session.deadline >= clock.t + 1.0, "no keepalive during the step"
        release.set()
        runner.join(60)
        got = run_until([prefill, decode], server, finished)
        assert not any(isinstance(m, RequestError) for m in got), got
        assert tokens(got) == colocated_tokens
        assert prefill.step_keepalive.num_sent >= 4
        run_until([prefill, decode], server,
                  lambda _: not prefill.sessions.by_state(TransferState.DRAINING), timeout_s=10)
        assert prefill.pool.allocator.num_used == 0 and decode.pool.allocator.num_used == 0
    finally:
        release.set()
        runner.join(60)
        prefill.core.step = step
        prefill.close()
        decode.close()
