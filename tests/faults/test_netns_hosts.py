"""Router, prefill worker and decode worker on three "hosts" (network namespaces joined by veth
links through a bridge, with netem delay and loss where the kernel has sch_netem): workers join with ``--router``, the KV pages
cross a real TCP link, and a partitioned decode host is declared dead, fails its requests with
503, and is taken back when the link heals. Skipped (with the reason) when not root or when
namespaces cannot be created."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tests.faults.netns import Hosts, NetnsUnavailable

pytestmark = pytest.mark.slow

PORT = 8000
DEAD_AFTER_S = 3.0

# The router listens beyond loopback: workers join it (an operator route) with this key.
KEY = "sk-netns-operator"
CLIENT = r"""
import json, sys, httpx
url, body, auth = sys.argv[1], json.loads(sys.argv[2]), {"Authorization": "Bearer " + sys.argv[3]}
if body.get("_get"):
    r = httpx.get(url + body["_get"], headers=auth, timeout=10)
    print(json.dumps({"status": r.status_code, "json": r.json()}))
else:
    r = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=120)
    print(json.dumps({"status": r.status_code, "json": r.json()}))
"""


@pytest.fixture(scope="module")
def hosts():
    try:
        with Hosts(["router", "prefill", "decode"]) as h:
            yield h
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")


def _http(hosts: Hosts, body: dict) -> dict:
    url = f"http://{hosts.addr['router']}:{PORT}"
    r = subprocess.run(hosts.cmd("router", [sys.executable, "-c", CLIENT, url, json.dumps(body),
                                            KEY]),
                       check=False, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _workers(hosts: Hosts) -> dict[str, dict]:
    return {w["worker_id"]: w for w in _http(hosts, {"_get": "/workers"})["json"]}


def _wait(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.5)
    return value


def test_three_hosts_kv_over_real_tcp(hosts: Hosts, model_path: Path) -> None:
    try:
        hosts.netem("decode", "delay 2ms loss 0.5%")
    except NetnsUnavailable as exc:  # e.g. a container kernel without sch_netem
        warnings.warn(f"tc netem unavailable, running without delay/loss: {exc}", stacklevel=1)
    env = dict(os.environ, OMP_NUM_THREADS="1", SPLITSERVE_API_KEY=KEY)
    router_url = f"http://{hosts.addr['router']}:{PORT}"
    base = [sys.executable, "-m", "splitserve"]
    procs = [subprocess.Popen(hosts.cmd("router", [
        *base, "api-server", "--model", str(model_path), "--host", hosts.addr["router"],
        "--port", str(PORT), "--dead-after", str(DEAD_AFTER_S)]), env=env, start_new_session=True)]
    for role in ("prefill", "decode"):
        procs.append(subprocess.Popen(hosts.cmd(role, [
            *base, "worker", "--role", role, "--router", router_url, "--worker-id", role,
            "--host", hosts.addr[role], "--port", "7001", "--model", str(model_path),
            "--kv-cache-mb", "32", "--threads", "1"]), env=env, start_new_session=True))
    try:
        def up():
            try:
                rows = _workers(hosts)
            except AssertionError:
                return False
            return len(rows) == 2 and all(r["healthy"] for r in rows.values())

        _wait(up, 180, "both workers joined and healthy")
        rows = _workers(hosts)
        assert rows["prefill"]["addr"] == f"tcp://{hosts.addr['prefill']}:7001"
        assert rows["decode"]["addr"] == f"tcp://{hosts.addr['decode']}:7001"
        body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 12,
                "temperature": 0}
        r = _http(hosts, body)
        assert r["status"] == 200, r
        assert "Paris" in r["json"]["choices"][0]["text"]
        rows = _workers(hosts)
        assert rows["decode"]["kv_bytes_received"] > 0  # the KV crossed the veth link
        assert rows["decode"]["kv_bytes_received"] == rows["prefill"]["kv_bytes_sent"]

        # Partition the decode host: heartbeats stop, it is declared dead, requests get 503.
        hosts.set_link("decode", up=False)
        _wait(lambda: not _workers(hosts)["decode"]["healthy"], DEAD_AFTER_S + 5,
              "partitioned decode worker declared dead")
        r = _http(hosts, body)
        assert r["status"] == 503 and "no healthy" in r["json"]["error"]["message"]
        hosts.set_link("decode", up=True)
        _wait(lambda: _workers(hosts)["decode"]["healthy"], 30, "decode taken back")
        r = _http(hosts, body)
        assert r["status"] == 200 and "Paris" in r["json"]["choices"][0]["text"]
        _wait(lambda: all(w["pages_used"] - w.get("cache_evictable_pages", 0) == 0
                        for w in _workers(hosts).values()), 10,
              "zero pages in use")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
