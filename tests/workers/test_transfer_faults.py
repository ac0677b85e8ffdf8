"""Worker processes' transfer state machine, driven in-process: stalls time out, mismatched
layouts are refused at the handshake, and every page is freed."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import torch

from splitserve.engine.model.loader import load_model
from splitserve.ipc.messages import (
    GenerateTask,
    KVBootstrap,
    KVFailed,
    KVKeepalive,
    KVLayoutMsg,
    KVPages,
    KVQueued,
    RequestError,
    SamplingParams,
    TokenBatch,
    WeightsMsg,
)
from splitserve.ipc.sockets import Inbox, free_tcp_addr
from splitserve.kv_transfer.base import weights_mismatch
from splitserve.kv_transfer.session import TransferState
from splitserve.worker.main import create_worker
from tests.cluster_config import worker_config

TIMEOUT_S = 0.5


def make_worker(model_path: Path, role: str, server_addr: str):
    return create_worker(worker_config(model_path, role, server_addr, kv_cache_mb=16,
                                       transfer_timeout_s=TIMEOUT_S))


def pump(worker, inbox: Inbox, until, timeout_s: float = 10.0) -> list:
    """Run the worker loop until ``until(messages)`` holds; return what the peer inbox got."""
    got = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        worker.run_once(idle_wait_ms=10)
        while (item := inbox.recv()) is not None:
            got.append(item[0])
        if until(got):
            return got
    raise AssertionError(f"condition not met; received {got}")


def task(server: Inbox, prefill_addr: str | None = None) -> GenerateTask:
    return GenerateTask(rid="r1", input_ids=list(range(10, 60)), reply_addr=server.addr,
                        sampling=SamplingParams(max_new_tokens=8, temperature=0),
                        prefill_addr=prefill_addr)


def errors(got: list) -> list[RequestError]:
    return [m for m in got if isinstance(m, RequestError)]


def assert_pages_back(worker) -> None:
    """No request holds a page: what is used is the prefix cache's, unpinned, and a flush
    frees it all."""
    cache = worker.scheduler.cache.stats()
    assert worker.pool.allocator.num_used == cache.cached_pages == cache.evictable_pages
    worker.scheduler.cache.flush()
    assert worker.pool.allocator.num_used == 0


def test_decode_times_out_when_prefill_never_sends(ctx, model_path) -> None:
    server, dead_prefill = Inbox(ctx, free_tcp_addr()), Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "decode", server.addr)
    worker.dispatch(task(server, prefill_addr=dead_prefill.addr), [])
    assert worker.pool.allocator.num_used > 0  # pages reserved for the prompt
    got = pump(worker, server, lambda g: errors(g), timeout_s=TIMEOUT_S + 2)
    assert "timed out" in errors(got)[0].message and errors(got)[0].code == 504
    assert worker.pool.allocator.num_used == 0
    boot = pump(worker, dead_prefill, lambda g: any(isinstance(m, KVFailed) for m in g))
    assert isinstance(boot[0], KVBootstrap)  # the handshake went out, then the failure notice


def test_prefill_times_out_without_bootstrap(ctx, model_path) -> None:
    server = Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "prefill", server.addr)
    worker.dispatch(task(server), [])
    got = pump(worker, server, lambda g: errors(g))
    assert any(isinstance(m, TokenBatch) for m in got)  # the first token still went out
    assert "no decode worker bootstrap" in errors(got)[0].message
    assert not worker.sessions
    assert_pages_back(worker)


def test_prefill_refuses_mismatched_layout(ctx, model_path) -> None:
    server, decode = Inbox(ctx, free_tcp_addr()), Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "prefill", server.addr)
    worker.dispatch(task(server), [])
    lay = worker.pool.layout
    wrong = KVLayoutMsg(lay.num_layers, lay.num_kv_heads, lay.head_dim, 32, "bfloat16")
    worker.dispatch(KVBootstrap(rid="r1", dst_addr=decode.addr, page_ids=[1, 2, 3, 4], layout=wrong), [])
    got = pump(worker, decode, lambda g: g)
    assert isinstance(got[0], KVFailed)
    assert "page_size: 16 here vs 32" in got[0].message and "dtype: float32 here vs bfloat16" in got[0].message
    err = pump(worker, server, lambda g: errors(g))
    assert "page_size" in errors(err)[0].message
    worker.run_once()
    assert_pages_back(worker)


def refused_bootstrap(ctx, worker, server: Inbox, weights: WeightsMsg | None) -> str:
    """Send the prefill ``worker`` a bootstrap whose layout matches its own and whose weights
    are ``weights``; returns the refusal the decode side gets, once the server has been told
    and every page is back."""
    decode = Inbox(ctx, free_tcp_addr())
    worker.dispatch(task(server), [])
    lay = worker.pool.layout
    layout = KVLayoutMsg(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.page_size, lay.dtype)
    worker.dispatch(KVBootstrap(rid="r1", dst_addr=decode.addr, page_ids=[1, 2, 3, 4],
                                layout=layout, kv_transfer=worker.config.engine.kv_transfer,
                                weights=weights), [])
    got = pump(worker, decode, lambda g: g)
    assert isinstance(got[0], KVFailed) and "weights mismatch" in got[0].message
    err = pump(worker, server, lambda g: errors(g))
    assert "weights mismatch" in errors(err)[0].message
    worker.run_once()
    assert_pages_back(worker)
    return got[0].message


@pytest.mark.parametrize("weights", [
    # another model's config (and so its weights)
    WeightsMsg("Qwen2ForCausalLM", "0123456789abcdef", "none", "fedcba9876543210"),
    None,  # a bootstrap that does not say
])
def test_prefill_refuses_other_weights(ctx, model_path, weights) -> None:
    """The decode worker's layout matches but its model does not (or it does not say which):
    the prefill worker refuses, naming both sides, and frees its pages."""
    server = Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "prefill", server.addr)
    message = refused_bootstrap(ctx, worker, server, weights)
    if weights is not None:
        here = worker.weights.config_fingerprint
        assert f"config_fingerprint: {here} here vs 0123456789abcdef on the decode worker" in (
            message)
        assert "quantization" not in message  # only the fields that differ are named
    else:
        assert "does not name its weights" in message


def test_prefill_refuses_a_fine_tune_of_its_model(ctx, model, model_path, fine_tune_path) -> None:
    """A decode worker on another checkpoint of the same config (a fine-tune: one tensor's
    values changed) sends the weights identity its load gives; the prefill worker refuses it,
    naming both weights digests and nothing else."""
    server = Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "prefill", server.addr)
    tuned, config = load_model(fine_tune_path, torch.float32)
    here = worker.weights
    assert here.weights_digest == model[0].weights_digest  # the worker sends its model's
    peer = WeightsMsg(config.architecture, config.fingerprint(), here.quantization,
                      tuned.weights_digest)
    assert peer.config_fingerprint == here.config_fingerprint  # the config cannot tell
    message = refused_bootstrap(ctx, worker, server, peer)
    assert (f"weights_digest: {here.weights_digest} here vs {tuned.weights_digest} on the "
            "decode worker") in message
    assert "config_fingerprint" not in message and "quantization" not in message


def test_a_peer_of_an_earlier_version_is_refused_by_name() -> None:
    """A bootstrap from a decode worker that predates the weights digest decodes (the field
    defaults to empty) and is refused, naming the digest, rather than dropped as malformed."""
    old = msgspec.msgpack.encode(
        {"architecture": "LlamaForCausalLM", "config_fingerprint": "f", "quantization": "none"})
    peer = msgspec.msgpack.decode(old, type=WeightsMsg)
    here = WeightsMsg("LlamaForCausalLM", "f", "none", "0123456789abcdef")
    assert weights_mismatch(here, peer) == (
        "weights mismatch (weights_digest: 0123456789abcdef here vs (not sent) on the decode "
        "worker)")
    assert weights_mismatch(here, here) is None


def test_prompt_larger_than_pool_is_refused(ctx, model_path) -> None:
    server = Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "colocated", server.addr)
    capacity = (worker.pool.allocator.num_pages - 1) * worker.pool.page_size
    big = GenerateTask(rid="big", input_ids=[5] * (capacity + 1), reply_addr=server.addr,
                       sampling=SamplingParams(max_new_tokens=4))
    worker.dispatch(big, [])
    got = pump(worker, server, lambda g: errors(g))
    assert errors(got)[0].code == 400 and "does not fit the KV pool" in errors(got)[0].message
    # The worker still serves the next request.
    worker.dispatch(task(server), [])
    got = pump(worker, server, lambda g: any(
        isinstance(m, TokenBatch) and m.outputs[-1].finish_reason for m in g))
    assert_pages_back(worker)


def test_output_is_capped_at_the_pool_when_the_pool_is_smaller_than_the_context(
    ctx, model_path
) -> None:
    """A prompt that fits the pool with room for only a few tokens, asking for many: it ends
    with ``length`` where the pool is full (before, retracted and never re-admittable, it
    wedged the worker), every page comes back and the next request is served."""
    server = Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "colocated", server.addr)
    capacity = (worker.pool.allocator.num_pages - 1) * worker.pool.page_size
    assert capacity < worker.model_config.context_len
    big = GenerateTask(rid="big", input_ids=[5] * (capacity - 6), reply_addr=server.addr,
                       sampling=SamplingParams(max_new_tokens=50, ignore_eos=True))
    worker.dispatch(big, [])
    got = pump(worker, server, lambda g: any(
        isinstance(m, TokenBatch) and m.outputs[-1].finish_reason for m in g), timeout_s=60)
    outs = [o for m in got if isinstance(m, TokenBatch) for o in m.outputs]
    assert outs[-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in outs) == 6
    worker.dispatch(task(server), [])
    pump(worker, server, lambda g: any(
        isinstance(m, TokenBatch) and m.outputs[-1].finish_reason for m in g))
    assert_pages_back(worker)


def test_keepalives_hold_the_decode_timer_and_silence_trips_it(ctx, model_path) -> None:
    """A request queued at a live prefill worker is not a stall; a silent one is."""
    server, prefill = Inbox(ctx, free_tcp_addr()), Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "decode", server.addr)
    worker.dispatch(task(server, prefill_addr=prefill.addr), [])
    keepalive = KVKeepalive(rid="r1")
    t_end = time.monotonic() + 3 * TIMEOUT_S
    while time.monotonic() < t_end:  # the prefill side keeps saying "still here"
        worker.dispatch(keepalive, [])
        worker.run_once(idle_wait_ms=10)
        time.sleep(TIMEOUT_S / 5)
    assert worker.sessions.get("r1").state is TransferState.WAITING_FOR_PAGES
    assert worker.pool.allocator.num_used > 0
    got = pump(worker, server, lambda g: errors(g))  # then silence
    assert "timed out" in errors(got)[0].message
    assert worker.pool.allocator.num_used == 0


def test_prefill_acks_the_bootstrap(ctx, model_path) -> None:
    server, decode = Inbox(ctx, free_tcp_addr()), Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "prefill", server.addr)
    worker.dispatch(task(server), [])
    lay = worker.pool.layout
    layout = KVLayoutMsg(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.page_size, lay.dtype)
    worker.dispatch(KVBootstrap(rid="r1", dst_addr=decode.addr, page_ids=[1, 2, 3, 4],
                                layout=layout, kv_transfer=worker.config.engine.kv_transfer,
                                weights=worker.weights), [])
    got = pump(worker, decode, lambda g: any(isinstance(m, KVPages) and m.last for m in g))
    assert isinstance(got[0], KVKeepalive)  # the ack comes before any page


def test_a_request_queued_for_decode_pages_is_kept_alive(ctx, model_path) -> None:
    """Waiting for pages that running requests hold is not a stall: the decode worker keeps the
    request queued past the timeout, telling the prefill worker (KVQueued), and bootstraps it
    as soon as pages free up."""
    server, prefill = Inbox(ctx, free_tcp_addr()), Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "decode", server.addr)
    held = worker.pool.allocator.alloc(worker.pool.allocator.num_free - 2)  # "running requests"
    worker.dispatch(task(server, prefill_addr=prefill.addr), [])
    got, to_client = [], []
    t_end = time.monotonic() + 4 * TIMEOUT_S
    while time.monotonic() < t_end:
        worker.run_once(idle_wait_ms=10)
        while (item := prefill.recv()) is not None:
            got.append(item[0])
        while (item := server.recv()) is not None:
            to_client.append(item[0])
    assert not errors(to_client)
    assert [m.rid for m in got if isinstance(m, KVQueued)].count("r1") >= 3
    assert [s.rid for s in worker.sessions.by_state(TransferState.QUEUED)] == ["r1"]
    assert not worker.sessions.by_state(TransferState.WAITING_FOR_PAGES)
    worker.pool.allocator.free(held)  # the running requests finish: the loop admits
    boot = pump(worker, prefill, lambda g: any(isinstance(m, KVBootstrap) for m in g))
    assert any(isinstance(m, KVBootstrap) and m.rid == "r1" for m in boot)


def test_prefill_waits_for_a_bootstrap_while_decode_says_queued(ctx, model_path) -> None:
    server = Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "prefill", server.addr)
    worker.dispatch(task(server), [])
    t_end = time.monotonic() + 3 * TIMEOUT_S
    got: list = []
    while time.monotonic() < t_end:  # the decode worker keeps saying "queued"
        worker.dispatch(KVQueued("r1"), [])
        worker.run_once(idle_wait_ms=10)
        while (item := server.recv()) is not None:
            got.append(item[0])
        time.sleep(TIMEOUT_S / 5)
    assert not errors(got) and "r1" in worker.sessions
    got = pump(worker, server, lambda g: errors(g))  # then silence
    assert "no decode worker bootstrap" in errors(got)[0].message
    assert_pages_back(worker)


def test_a_queued_request_times_out_once_the_prefill_link_drops(ctx, model_path) -> None:
    """The prefill worker went away (its process, and the prompt's KV with it): keepalives stop
    holding the queued request, which fails with 504."""
    server, prefill = Inbox(ctx, free_tcp_addr()), Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "decode", server.addr)
    worker.pool.allocator.alloc(worker.pool.allocator.num_free - 2)  # no room: it queues
    worker.dispatch(task(server, prefill_addr=prefill.addr), [])
    pump(worker, prefill, lambda g: any(isinstance(m, KVQueued) for m in g))  # link is up
    prefill.sock.close(linger=0)
    got = pump(worker, server, lambda g: errors(g), timeout_s=2 * TIMEOUT_S + 1)
    assert errors(got)[0].code == 504 and "reserving KV pages" in errors(got)[0].message
    assert not worker.sessions.by_state(TransferState.QUEUED)


def test_a_duplicate_bootstrap_is_logged_and_dropped(ctx, model_path, caplog) -> None:
    """A message its transfer session cannot take (a peer's bug) is an error in the log, not a
    dead worker: the request's transfer goes on."""
    server, decode = Inbox(ctx, free_tcp_addr()), Inbox(ctx, free_tcp_addr())
    worker = make_worker(model_path, "prefill", server.addr)
    worker.dispatch(task(server), [])
    lay = worker.pool.layout
    layout = KVLayoutMsg(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.page_size, lay.dtype)
    boot = KVBootstrap(rid="r1", dst_addr=decode.addr, page_ids=[1, 2, 3, 4], layout=layout,
                       kv_transfer=worker.config.engine.kv_transfer, weights=worker.weights)
    worker.dispatch(boot, [])
    worker.dispatch(boot, [])
    assert "BOOTSTRAP in state TRANSFERRING" in caplog.text
    pump(worker, decode, lambda g: any(isinstance(m, KVPages) and m.last for m in g))
