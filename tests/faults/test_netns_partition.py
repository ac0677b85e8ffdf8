"""Partitions, not closed sockets: a router, a prefill worker and two decode workers on four
"hosts" (network namespaces behind one bridge), and a link whose packets are dropped (no reset,
no ICMP: ``Hosts.partition``) while requests use it.

- prefill <-> decode-a, **mid-transfer** (a long prompt whose KV pages stream chunk by chunk,
  cut after the first pages arrived): decode-a hears nothing for ``--transfer-timeout`` and fails
  the request (504 to the client); the router aborts it on the prefill worker; both free their
  pages; a request on decode-b meanwhile succeeds; once the link is back decode-a serves again.
- router <-> decode-b, mid-stream: the router hears no heartbeat for ``--dead-after`` and ends
  the stream with a 503 error event; decode-b hears no ``RouterBeat`` for the same bound and ends
  the request itself (``requests_orphaned``), freeing its pages while still cut off; other
  requests go to decode-a; when the link is back decode-b is taken back and serves.

Every HTTP call runs in a thread inside the router's namespace (``Hosts.executor``): nothing is
sent outside the test's namespaces. Skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.faults.helpers import stream_completion
from tests.faults.netns import Hosts, NetnsUnavailable

pytestmark = pytest.mark.slow

PORT = 8000
DEAD_AFTER_S = 2.0  # router <-> worker, both ways
TRANSFER_TIMEOUT_S = 3.0  # prefill <-> decode
SLACK_S = 2.5  # on a loaded 2-core machine: a step, a health tick, a poll
SHORT = {"model": "default", "prompt": "The capital of France is", "max_tokens": 6,
         "temperature": 0}
# ~500 tokens, prefilled 32 at a time: its pages stream to decode for several seconds.
LONG_PROMPT = "Here is a list of facts about the planets of the solar system. " * 40


KEY = "sk-netns-operator"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Net:
    """The four hosts, the processes on them, and an HTTP client inside the router's host."""

    def __init__(self, hosts: Hosts) -> None:
        self.hosts = hosts
        self.url = f"http://{hosts.addr['router']}:{PORT}"
        self.pool = hosts.executor("router")
        self.procs: list[subprocess.Popen] = []

    def run(self, fn, *args):
        """``fn(*args)`` in a thread inside the router's host; its result."""
        return self.pool.submit(fn, *args).result()

    def start(self, fn, *args):
        return self.pool.submit(fn, *args)

    def workers(self) -> dict[str, dict]:
        rows = self.run(lambda: httpx.get(self.url + "/workers", headers=AUTH, timeout=10).json())
        return {r["worker_id"]: r for r in rows}

    def post(self, path: str, body: dict | None = None) -> httpx.Response:
        return self.run(lambda: httpx.post(self.url + path, json=body or {}, headers=AUTH,
                                           timeout=60))

    def held(self, worker_id: str) -> int:
        """Pages ``worker_id`` holds for requests (used minus the cache's evictable ones)."""
        w = self.workers()[worker_id]
        return w["pages_used"] - w.get("cache_evictable_pages", 0)


def _wait(cond, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(interval_s)
    return value


@pytest.fixture(scope="module")
def net(model_path: Path):
    try:
        hosts = Hosts(["router", "prefill", "da", "db"]).__enter__()
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    n = Net(hosts)
    # The router listens beyond loopback: its operator routes (register, drain) need the key.
    env = dict(os.environ, OMP_NUM_THREADS="1", SPLITSERVE_API_KEY=KEY)
    base = [sys.executable, "-m", "splitserve"]
    try:
        n.procs.append(subprocess.Popen(hosts.cmd("router", [
            *base, "api-server", "--model", str(model_path), "--host", hosts.addr["router"],
            "--port", str(PORT), "--dead-after", str(DEAD_AFTER_S),
        ]), env=env, start_new_session=True))
        for name, extra in (("prefill", ["--role", "prefill", "--max-batch-tokens", "32"]),
                            ("da", ["--role", "decode"]), ("db", ["--role", "decode"])):
            n.procs.append(subprocess.Popen(hosts.cmd(name, [
                *base, "worker", *extra, "--router", n.url, "--worker-id", name,
                "--host", hosts.addr[name], "--port", "7001", "--model", str(model_path),
                "--kv-cache-mb", "48", "--threads", "1", "--dtype", "float32",
                "--transfer-timeout", str(TRANSFER_TIMEOUT_S),
            ]), env=env, start_new_session=True))

        def up():
            for p in n.procs:
                assert p.poll() is None, f"{p.args[4:7]} exited with {p.returncode}"
            try:
                rows = n.workers()
            except httpx.HTTPError:
                return False
            return len(rows) == 3 and all(r["healthy"] for r in rows.values())

        _wait(up, 180, "three workers joined and healthy", interval_s=0.5)
        yield n
    finally:
        for p in n.procs:
            p.terminate()
        for p in n.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        n.pool.shutdown(wait=False, cancel_futures=True)
        hosts.__exit__()


def _short_text(net: Net) -> str:
    r = net.post("/v1/completions", SHORT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _serves(net: Net, ref: str) -> bool:
    """One short request succeeds with the reference text (an error is a False, to retry)."""
    r = net.post("/v1/completions", SHORT)
    return r.status_code == 200 and r.json()["choices"][0]["text"] == ref


def _drain(net: Net, worker_id: str) -> None:
    """Route new requests to the other decode worker (undone by ``_resume``)."""
    assert net.post(f"/workers/{worker_id}/drain").status_code == 200


def _resume(net: Net, *worker_ids: str) -> None:
    for w in worker_ids:
        assert net.post(f"/workers/{w}/resume").status_code == 200


def test_prefill_decode_partition_mid_transfer(net: Net) -> None:
    ref = _short_text(net)
    before = net.workers()["da"]["kv_pages_received"]
    _drain(net, "db")
    long_body = {"model": "default", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
    pending = net.start(stream_completion, net.url, long_body, None, 120, AUTH)
    # Cut once the first chunks' pages have reached decode-a, while the rest is computed.
    _wait(lambda: net.workers()["da"]["kv_pages_received"] > before, 60,
          "the first KV pages of the long prompt at decode-a")
    net.hosts.partition("prefill", "da")
    cut_at = time.monotonic()
    _resume(net, "db")
    try:
        # Other requests carry on: decode-b's link to the prefill worker is whole.
        assert _short_text(net) == ref
        res = pending.result(timeout=TRANSFER_TIMEOUT_S + 30)
        assert res.error is not None, f"the cut request succeeded: {res.text!r}"
        assert "KV transfer timed out" in res.error["message"], res.error
        error_s = res.ended_at - cut_at
        assert error_s < TRANSFER_TIMEOUT_S + SLACK_S, error_s
        rows = net.workers()
        assert 0 < rows["da"]["kv_pages_received"] - before  # it was cut mid-transfer
        assert rows["da"]["transfer_failures"] >= 1
        # Both sides freed the request's pages, still cut off from each other: decode-a at its
        # timeout, the prefill worker on the router's abort (or, had it sent its last pages
        # into the cut link already, at its own drain deadline).
        _wait(lambda: net.held("da") == 0 and net.held("prefill") == 0,
              TRANSFER_TIMEOUT_S + SLACK_S, "zero pages on prefill and decode-a while cut")
        freed_s = time.monotonic() - cut_at
    finally:
        net.hosts.partition("prefill", "da", cut=False)
    healed_at = time.monotonic()
    _drain(net, "db")
    try:
        # TCP retransmits with backoff: the link carries again within a few seconds.
        _wait(lambda: _serves(net, ref), 30, "decode-a serves again", interval_s=0.5)
    finally:
        _resume(net, "db")
    recovered_s = time.monotonic() - healed_at
    assert net.workers()["da"]["kv_pages_received"] > rows["da"]["kv_pages_received"]
    _wait(lambda: all(net.held(w) == 0 for w in ("prefill", "da", "db")), 10, "zero pages")
    print(f"\nprefill<->decode cut mid-transfer: client error {error_s:.2f} s after the cut "
          f"(--transfer-timeout {TRANSFER_TIMEOUT_S:g} s), pages freed on both by "
          f"{freed_s:.2f} s, decode-a serving {recovered_s:.2f} s after the link came back")


def test_router_worker_partition(net: Net) -> None:
    ref = _short_text(net)
    orphaned = net.workers()["db"]["requests_orphaned"]
    streaming = threading.Event()
    _drain(net, "da")
    body = {"model": "default", "prompt": "Count from one to one thousand:", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True}
    pending = net.start(stream_completion, net.url, body,
                        lambda r: r.num_chunks >= 3 and streaming.set(), 120, AUTH)
    assert streaming.wait(60), "the long stream never started"
    net.hosts.partition("router", "db")
    cut_at = time.monotonic()
    _resume(net, "da")
    try:
        res = pending.result(timeout=DEAD_AFTER_S + 30)
        error_s = res.ended_at - cut_at
        assert res.error is not None and res.finish_reason is None, res
        assert "heartbeat" in res.error["message"], res.error
        assert error_s < DEAD_AFTER_S + SLACK_S, error_s
        assert not net.workers()["db"]["healthy"]
        assert _short_text(net) == ref  # served by decode-a meanwhile
        # decode-b ends the request itself, within the same bound, while still cut off:
        # counted now, reported when its heartbeats get through again.
        time.sleep(max(0.0, DEAD_AFTER_S + SLACK_S - (time.monotonic() - cut_at)))
    finally:
        net.hosts.partition("router", "db", cut=False)
    healed_at = time.monotonic()
    row = _wait(lambda: (w := net.workers()["db"])["healthy"] and w, 30, "decode-b taken back")
    back_s = time.monotonic() - healed_at
    assert row["requests_orphaned"] == orphaned + 1  # ended by decode-b, not by a late abort
    assert row["pages_used"] - row.get("cache_evictable_pages", 0) == 0
    _drain(net, "da")
    try:
        assert _short_text(net) == ref
    finally:
        _resume(net, "da")
    _wait(lambda: all(net.held(w) == 0 for w in ("prefill", "da", "db")), 10, "zero pages")
    print(f"\nrouter<->decode cut mid-stream: client error {error_s:.2f} s after the cut "
          f"(--dead-after {DEAD_AFTER_S:g} s); decode-b ended it on its own; taken back "
          f"{back_s:.2f} s after the link came back")
