"""A launched 1 prefill + 1 decode cluster with an API key, CURVE on every worker link and low
in-flight and queue limits: requests past the slots wait, past the queue get 429 + Retry-After; a worker fed a pickle payload and garbage frames
rejects them and keeps serving; unauthenticated ZeroMQ peers get nothing; a worker joins with
``splitserve worker --router``, is listed by ``GET /workers``, and draining moves traffic off
another."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import zmq

from splitserve.ipc.messages import StatsQuery, WorkerStats, decode, encode
from splitserve.ipc.security import (
    CurveKeys,
    apply_curve_client,
    apply_curve_server,
    start_authenticator,
)
from splitserve.ipc.sockets import free_tcp_addr
from splitserve.launch.local import Cluster
from tests.cluster_config import serve_config
from tests.faults.helpers import assert_no_pages, complete, wait_all_healthy, wait_until, workers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE (no libsodium)"),
]

KEY = "sk-cluster-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_INFLIGHT = 2
MAX_QUEUED = 2


@pytest.fixture(scope="module")
def keyfile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("curve") / "cluster.keys"
    CurveKeys.generate().save(path)
    return path


@pytest.fixture(scope="module")
def cluster(model_path: Path, keyfile: Path):
    spec = serve_config(model_path, kv_cache_mb=32, threads_per_worker=1, api_key=KEY,
                        curve_keys=str(keyfile), max_inflight_per_worker=MAX_INFLIGHT,
                        max_queued_per_worker=MAX_QUEUED,
                        max_body_bytes=64 * 1024)
    with Cluster(spec) as c:
        yield c


def _body(prompt: str, max_tokens: int) -> dict:
    return {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def test_api_key_and_body_limit(cluster) -> None:
    url = cluster.config.url
    r = complete(url, _body("hi", 2))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert complete(url, _body("hi", 2), headers=AUTH).status_code == 200
    r = complete(url, _body("hi " * 40000, 2), headers=AUTH)
    assert r.status_code == 413
    assert httpx.get(url + "/health").status_code == 200


def test_overload_waits_then_gets_429_with_retry_after(cluster) -> None:
    url = cluster.config.url
    ref = complete(url, _body("Count to ten:", 40), headers=AUTH).json()["choices"][0]["text"]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(
            lambda _: complete(url, _body("Count to ten:", 40), headers=AUTH), range(8)))
    busy = [r for r in results if r.status_code == 429]
    ok = [r for r in results if r.status_code == 200]
    # 2 run and 2 wait; the rest are refused (some may come after a slot freed).
    assert busy and len(ok) >= MAX_INFLIGHT + MAX_QUEUED and len(busy) + len(ok) == 8
    for r in busy:
        assert 1 <= int(r.headers["retry-after"]) <= 60 and int(r.headers["retry-after-ms"]) > 0
        err = r.json()["error"]
        assert "overloaded" in err["message"] and err["type"] == "rate_limit_error"
    assert all(r.json()["choices"][0]["text"] == ref for r in ok)
    for row in workers(cluster, AUTH).values():
        assert row["pages_used"] <= row["pages_total"]
        assert row["kv_pool_bytes"] > 0 and row["weight_bytes"] > 0
    assert_no_pages(cluster, headers=AUTH)


def _stats_roundtrip(worker_addr: str, keys: CurveKeys | None, server_keys: CurveKeys,
                     junk: list[list[bytes]] = ()) -> bool:
    """Send ``junk`` then a StatsQuery to a worker inbox; whether a reply came within 3 s."""
    ctx = zmq.Context()
    auth = start_authenticator(ctx, server_keys)
    try:
        inbox = ctx.socket(zmq.PULL)
        apply_curve_server(inbox, server_keys)
        reply_addr = free_tcp_addr()
        inbox.bind(reply_addr)
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            apply_curve_client(out, keys)
            out.curve_serverkey = server_keys.public
        out.connect(worker_addr)
        for frames in junk:
            out.send_multipart(frames)
        out.send(encode(StatsQuery(4242, reply_addr)))
        if not inbox.poll(3000):
            return False
        msg = decode(inbox.recv_multipart()[0])
        return isinstance(msg, WorkerStats) and msg.query_id == 4242
    finally:
        auth.stop()
        ctx.destroy(linger=0)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_worker_rejects_pickle_and_garbage_and_stays_up(cluster, keyfile, tmp_path) -> None:
    keys = CurveKeys.load(keyfile)
    marker = tmp_path / "pwned"
    junk = [
        [pickle.dumps(_Evil(marker))],
        [b"\x00\xff\xfe garbage"],
        [b"\x82\xa4type\xa8generate\xa3rid\x01", b"raw frame"],  # msgpack-ish, wrong shape
        [b""],
    ]
    for addr in cluster.addrs["prefill"] + cluster.addrs["decode"]:
        assert _stats_roundtrip(addr, keys, keys, junk), addr
    assert not marker.exists()
    assert complete(cluster.config.url, _body("Still alive?", 4), headers=AUTH).status_code == 200


def test_curve_refuses_peers_without_the_cluster_key(cluster, keyfile) -> None:
    keys = CurveKeys.load(keyfile)
    addr = cluster.addrs["decode"][0]
    assert not _stats_roundtrip(addr, None, keys)  # plain ZeroMQ
    stranger = CurveKeys.generate()  # CURVE, but a key the cluster does not know
    assert not _stats_roundtrip(addr, stranger, keys)
    assert _stats_roundtrip(addr, keys, keys)


def test_worker_joins_router_and_drain(cluster, keyfile, model_path) -> None:
    url = cluster.config.url
    r = httpx.post(url + "/workers/register", json={"role": "decode", "worker_id": "x",
                                                    "addr": "tcp://127.0.0.1:1"})
    assert r.status_code == 401  # joining needs the API key: a rogue worker would get prompts
    r = httpx.post(url + "/workers/register", headers=AUTH,
                   json={"role": "bogus", "worker_id": "x", "addr": "tcp://127.0.0.1:1"})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    env = dict(os.environ, SPLITSERVE_API_KEY=KEY, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "splitserve", "worker", "--role", "decode", "--router", url,
           "--worker-id", "decode-joined", "--model", str(model_path), "--kv-cache-mb", "32",
           "--threads", "1", "--curve-keys", str(keyfile),
           # The cluster's dtype: a worker on another one is refused at the KV handshake.
           "--dtype", cluster.config.engine.dtype]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        wait_all_healthy(cluster, 3, headers=AUTH)
        rows = workers(cluster, AUTH)
        joined = rows["decode-joined"]
        for field in ("role", "addr", "in_flight", "pages_used", "pages_total", "healthy",
                      "draining", "num_running", "num_waiting"):
            assert field in joined, field
        assert joined["role"] == "decode" and joined["addr"].startswith("tcp://127.0.0.1:")
        r = httpx.post(url + "/workers/decode-0/drain", json={}, headers=AUTH)
        assert r.status_code == 200 and r.json()["draining"]
        before = workers(cluster, AUTH)["decode-0"]["kv_bytes_received"]
        for i in range(3):
            assert complete(url, _body(f"Joined {i}", 4), headers=AUTH).status_code == 200
        rows = workers(cluster, AUTH)
        assert rows["decode-0"]["kv_bytes_received"] == before  # drained: no new requests
        assert rows["decode-joined"]["kv_bytes_received"] > 0
        assert httpx.post(url + "/workers/nope/drain", json={}, headers=AUTH).status_code == 404
        assert httpx.post(url + "/workers/decode-0/resume", json={},
                          headers=AUTH).json()["draining"] is False
        proc.terminate()
        proc.wait(30)
        wait_until(lambda: not workers(cluster, AUTH)["decode-joined"]["healthy"], 10,
                   "the stopped worker marked unhealthy")
        assert complete(url, _body("After leave", 4), headers=AUTH).status_code == 200
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_no_pages(cluster, headers=AUTH)
