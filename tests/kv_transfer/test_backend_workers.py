"""Prefill and decode workers driven in-process with each KV transfer backend: chunk-by-chunk
sends give the colocated worker's tokens, a backend mismatch is refused naming both, a sender
that dies mid-transfer makes the receiver time out and free every page, and shared-memory
segments are gone afterwards."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from splitserve.config import WorkerArgs
from splitserve.decode import worker as decode_worker
from splitserve.ipc import Inbox, free_tcp_addr
from splitserve.kv_transfer.shm_backend import PREFIX, SHM_DIR
from splitserve.messages import (
    GenerateTask,
    KVFailed,
    RequestError,
    SamplingParams,
    TokenBatch,
)
from splitserve.worker_main import create_worker

BACKENDS = [
    "zmq",
    "shm",
    pytest.param("mooncake", marks=pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="Mooncake Transfer Engine not installed (pip install 'splitserve[mooncake]')")),
]
PROMPT = list(range(100, 190))  # 90 tokens: chunks of 32 -> pages complete before the end
NEW_TOKENS = 6


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def make_worker(model_path: Path, role: str, server_addr: str, kv_transfer: str, **kw):
    args = WorkerArgs(role=role, worker_id=f"{role}-t", addr=free_tcp_addr(),
                      server_addr=server_addr, model_path=str(model_path), kv_cache_mb=16,
                      max_batch_tokens=32, num_threads=1, kv_transfer=kv_transfer,
                      # Transfer tests count pages; the prefix cache (tested elsewhere) would
                      # keep the prompt's pages after the request.
                      disable_radix_cache=True, **kw)
    return create_worker(args)


def task(server: Inbox, prefill_addr: str | None) -> GenerateTask:
    return GenerateTask(rid="r1", input_ids=PROMPT, reply_addr=server.addr,
                        sampling=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0),
                        prefill_addr=prefill_addr)


def drain(inbox: Inbox, got: list) -> None:
    while (item := inbox.recv()) is not None:
        got.append(item[0])


def tokens(got: list) -> list[int]:
    outs = sorted((o for m in got if isinstance(m, TokenBatch) for o in m.outputs),
                  key=lambda o: o.index)
    return [t for o in outs for t in o.token_ids]


def finished(got: list) -> bool:
    return any(isinstance(m, TokenBatch) and m.outputs[-1].finish_reason for m in got)


def run_until(workers, server: Inbox, until, timeout_s: float = 60.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for w in workers:
            w.run_once(idle_wait_ms=2)
        drain(server, got)
        if until(got):
            return got
    raise AssertionError(f"condition not met; received {got}")


def segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob(PREFIX + "*")}


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_transfer_equals_colocated(ctx, model_path, backend, colocated_tokens) -> None:
    server = Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, backend)
    decode = make_worker(model_path, "decode", server.addr, backend)
    t = task(server, None)
    prefill.dispatch(t, [])
    decode.dispatch(msgspec.structs.replace(t, prefill_addr=prefill.args.addr), [])
    got = run_until([prefill, decode], server, finished)
    assert not any(isinstance(m, RequestError) for m in got), got
    assert tokens(got) == colocated_tokens
    # Overlap: pages went out in several messages (chunks of 32 tokens over 16-token pages).
    assert prefill.sender.metrics.messages_sent >= 3
    assert decode.receiver.metrics.pages_received == -(-len(PROMPT) // 16)
    stats = decode.stats()
    assert stats.kv_transfer == backend and stats.kv_bytes_received > 0 and stats.kv_gbps > 0
    assert sum(stats.kv_latency_counts) == stats.kv_messages_received
    run_until([prefill, decode], server, lambda _: not prefill.draining, timeout_s=10)
    assert prefill.pool.allocator.num_used == 0 and decode.pool.allocator.num_used == 0
    decode.receiver.close()
    prefill.sender.close()


def test_backend_mismatch_refused_naming_both(ctx, model_path) -> None:
    server = Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, "zmq")
    decode = make_worker(model_path, "decode", server.addr, "shm")
    t = task(server, prefill.args.addr)
    prefill.dispatch(GenerateTask(rid="r1", input_ids=PROMPT, reply_addr=server.addr,
                                  sampling=t.sampling), [])
    decode.dispatch(t, [])
    got = run_until([prefill, decode], server,
                    lambda g: sum(isinstance(m, RequestError) for m in g) >= 2)
    msgs = [m.message for m in got if isinstance(m, RequestError)]
    assert any("'zmq' here vs 'shm' on the decode worker" in m for m in msgs), msgs
    run_until([prefill, decode], server,
              lambda _: decode.pool.allocator.num_used == 0 == prefill.pool.allocator.num_used,
              timeout_s=decode_worker.QUARANTINE_S + 5)
    decode.receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_dies_mid_transfer(ctx, model_path, backend, monkeypatch) -> None:
    """The prefill worker sends its first chunks, then stops for good: the decode worker times
    out, frees every page (after the one-sided quarantine) and the request ends with an error."""
    monkeypatch.setattr(decode_worker, "QUARANTINE_S", 0.5)
    before = segments()
    server = Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, backend)
    decode = make_worker(model_path, "decode", server.addr, backend, transfer_timeout_s=2.0)
    assert (len(segments() - before) == 1) == (backend == "shm")
    long_prompt = list(range(100, 400))  # 10 chunks of 32 tokens; 19 of the 21 pages
    sampling = SamplingParams(max_new_tokens=4, temperature=0)
    prefill.dispatch(GenerateTask(rid="r1", input_ids=long_prompt, reply_addr=server.addr,
                                  sampling=sampling), [])
    decode.dispatch(GenerateTask(rid="r1", input_ids=long_prompt, reply_addr=server.addr,
                                 sampling=sampling, prefill_addr=prefill.args.addr), [])
    # Run the prefill worker until it has shipped an early chunk, then it "dies".
    deadline = time.monotonic() + 60
    while prefill.sender.metrics.messages_sent == 0 and time.monotonic() < deadline:
        prefill.run_once(idle_wait_ms=2)
        prefill.sender.poll()
    assert prefill.sender.metrics.messages_sent >= 1 and not prefill.transfers["r1"].prefilled
    time.sleep(0.2)  # let the backend finish what it started
    prefill.sender.poll()
    prefill.sender.close()
    prefill.inbox.close()  # the prefill worker is gone
    prefill.outbox.close()
    t0 = time.monotonic()
    got = run_until([decode], server, lambda g: any(isinstance(m, RequestError) for m in g))
    assert decode.receiver.metrics.messages_received >= 1  # the early chunk(s) were installed
    err = next(m for m in got if isinstance(m, RequestError))
    assert err.code == 504 and "timed out receiving KV pages" in err.message
    assert time.monotonic() - t0 < 5
    run_until([decode], server, lambda _: decode.pool.allocator.num_used == 0, timeout_s=5)
    decode.receiver.close()
    assert segments() <= before


def test_failed_sends_notify_decode(ctx, model_path) -> None:
    """A bootstrap naming an unusable shm segment: the prefill worker fails the request and tells
    the decode worker, which frees its reservation."""
    server, decode_inbox = Inbox(ctx, free_tcp_addr()), Inbox(ctx, free_tcp_addr())
    prefill = make_worker(model_path, "prefill", server.addr, "shm")
    from splitserve.kv_transfer.base import layout_to_msg
    from splitserve.messages import KVBootstrap

    prefill.dispatch(GenerateTask(rid="r1", input_ids=PROMPT, reply_addr=server.addr,
                                  sampling=SamplingParams(max_new_tokens=4, temperature=0)), [])
    prefill.dispatch(KVBootstrap(rid="r1", dst_addr=decode_inbox.addr, page_ids=list(range(1, 7)),
                                 layout=layout_to_msg(prefill.pool.layout), kv_transfer="shm",
                                 endpoint={"shm_name": PREFIX + "0-missing", "num_pages": "8"}), [])
    got = run_until([prefill], decode_inbox, lambda g: any(isinstance(m, KVFailed) for m in g))
    assert "cannot map shm segment" in next(m for m in got if isinstance(m, KVFailed)).message
    assert prefill.pool.allocator.num_used == 0 and not prefill.transfers
