"""Faults in a launched 2 prefill + 2 decode cluster, each with a bound: a killed decode worker,
a killed prefill worker, a hung (SIGSTOPped) worker, a client hanging up, and the chaos soak (``bench/chaos.py``, shortened):
workers of both roles killed and stopped at random under mixed load. After each: every worker healthy, zero pages in use."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from splitserve.launch.local import Cluster
from tests.cluster_config import serve_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from chaos import run_soak

from tests.faults.helpers import (
    assert_no_pages,
    complete,
    metric,
    stream_completion,
    wait_all_healthy,
    wait_until,
    workers,
)

pytestmark = pytest.mark.slow

DETECT_BOUND_S = 5.0  # a killed worker's requests end this soon (socket monitor: ~immediate)
DEAD_AFTER_S = 5.0  # heartbeat silence before a hung worker is declared dead


@pytest.fixture(scope="module")
def cluster(model_path: Path):
    spec = serve_config(model_path, num_prefill=2, num_decode=2, kv_cache_mb=48,
                        threads_per_worker=1, dead_after_s=DEAD_AFTER_S, transfer_timeout_s=60)
    with Cluster(spec) as c:
        wait_all_healthy(c, 4)
        yield c


def _body(prompt: str, max_tokens: int, **kw) -> dict:
    return {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **kw}


def test_client_disconnect_frees_pages_at_once(cluster) -> None:
    url = cluster.config.url
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json=_body("Tell me a long story.", 400, stream=True)) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    assert_no_pages(cluster, timeout_s=2.0)  # both workers freed it, well before it would finish


def test_decode_killed_while_streaming(cluster) -> None:
    url = cluster.config.url
    prompts = [f"Story number {i}: once upon a time" for i in range(4)]
    started = [threading.Event() for _ in prompts]

    def run(i):
        def on_chunk(res):
            if res.num_chunks >= 3:
                started[i].set()
        try:
            return stream_completion(url, _body(prompts[i], 120), on_chunk)
        finally:
            started[i].set()

    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(run, i) for i in range(4)]
        for e in started:
            assert e.wait(120)
        t_kill = time.monotonic()
        cluster.kill("decode-0")
        try:
            results = [f.result(timeout=120) for f in futs]
        finally:
            cluster.restart("decode-0")
    failed = [r for r in results if r.error]
    ok = [(p, r) for p, r in zip(prompts, results) if not r.error]
    assert failed, "no stream was on the killed decode worker"
    for r in failed:  # fail fast: an error event, not a hang
        assert r.ended_at - t_kill < DETECT_BOUND_S, r.ended_at - t_kill
        assert "decode worker decode-0" in r.error["message"], r.error
    wait_all_healthy(cluster, 4)
    for p, r in ok:  # the others ran on to the end, correct
        assert r.finish_reason == "length"
        assert r.text == complete(url, _body(p, 120)).json()["choices"][0]["text"]
    assert_no_pages(cluster)


def test_prefill_killed(cluster) -> None:
    url = cluster.config.url
    prompts = [f"Request {i}. " + "The quick brown fox jumps over the lazy dog. " * 25
               for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        refs = list(pool.map(lambda p: complete(url, _body(p, 8)).json()["choices"][0]["text"],
                             prompts))
    retries_before = metric(cluster, "splitserve_request_retries_total")
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(complete, url, _body(p, 8)) for p in prompts]
        time.sleep(0.3)
        cluster.kill("prefill-0")
        t_kill = time.monotonic()
        try:
            results = [f.result(timeout=120) for f in futs]
        finally:
            cluster.restart("prefill-0")
    assert time.monotonic() - t_kill < 60
    n_ok = 0
    for ref, r in zip(refs, results):
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"] == ref
            n_ok += 1
        else:  # in flight on the dead worker: a clean 503
            assert r.status_code == 503, r.text
            assert "prefill worker prefill-0" in r.json()["error"]["message"]
            assert r.headers["retry-after"]
    # Requests queued on prefill-0 (no token yet) were re-run on prefill-1.
    assert metric(cluster, "splitserve_request_retries_total") > retries_before
    assert n_ok >= 1
    wait_all_healthy(cluster, 4)
    assert_no_pages(cluster)


def test_hung_worker_fails_its_requests_and_is_taken_back(cluster) -> None:
    """SIGSTOP keeps the TCP link up: only the heartbeat notices. Stalled transfers to and from
    the hung worker end on both sides."""
    url = cluster.config.url
    started = [threading.Event() for _ in range(4)]

    def run(i):
        def on_chunk(res):
            if res.num_chunks >= 3:
                started[i].set()
        try:
            return stream_completion(url, _body(f"Poem {i} about the sea:", 150), on_chunk)
        finally:
            started[i].set()

    pid = cluster.proc("decode-1").pid
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(run, i) for i in range(4)]
        for e in started:
            assert e.wait(120)
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            results = [f.result(timeout=120) for f in futs]
            failed = [r for r in results if r.error]
            assert failed
            for r in failed:
                assert r.ended_at - t_stop < DEAD_AFTER_S + 5, r.ended_at - t_stop
                assert "decode worker decode-1 sent no heartbeat" in r.error["message"]
            assert not workers(cluster)["decode-1"]["healthy"]
            # Meanwhile new requests go to the healthy decode worker.
            r = complete(url, _body("Hello", 4))
            assert r.status_code == 200, r.text
        finally:
            os.kill(pid, signal.SIGCONT)
    wait_until(lambda: workers(cluster)["decode-1"]["healthy"], 10, "decode-1 taken back")
    assert_no_pages(cluster)


def test_chaos_soak(cluster) -> None:
    """The shortened chaos soak (``bench/chaos.py``): mixed requests (streaming or not, regex,
    choice or free, short or long prompts with a shared prefix) at concurrency 32 while a
    seeded schedule SIGKILLs and restarts a worker of one role and SIGSTOPs/SIGCONTs one of the
    other: every request ends with the reference greedy output or a clear error within its
    fault's bound, none is lost or hangs, no page is held afterwards, RSS stays bounded."""
    report = run_soak(cluster, num_requests=64, concurrency=32, num_faults=2, seed=19,
                      request_timeout_s=120)
    print(report.summary())
    assert {(f.kind, f.worker.split("-")[0]) for f in report.faults} in (
        {("kill", "prefill"), ("stop", "decode")}, {("kill", "decode"), ("stop", "prefill")})
    assert not report.lost, [(o.index, o.text) for o in report.lost[:3]]
    assert not report.wrong, [(o.index, o.text) for o in report.wrong[:3]]
    for o in report.outcomes:
        if o.kind == "error":
            assert o.text and o.status in (503, 504, "503", "504", 0), (o.status, o.text)
    for key, delay, o in report.attributed:
        bound = DETECT_BOUND_S if key.startswith("kill") else DEAD_AFTER_S + 5
        assert delay < bound, (key, delay, o.text, report.summary())
    for name, (first, peak) in report.rss_mb.items():
        assert peak < 2 * first + 200, (name, first, peak)  # generous: restarts reload the model
    wait_all_healthy(cluster, 4)
    assert_no_pages(cluster)


def test_metrics_after_faults(cluster) -> None:
    """Runs last in this module: latencies were observed, worker gauges are there, the kills and
    KV traffic are counted."""
    for name in ("splitserve_time_to_first_token_seconds_count",
                 "splitserve_inter_token_latency_seconds_count",
                 "splitserve_e2e_request_latency_seconds_count",
                 "splitserve_worker_kv_bytes_sent_total", "splitserve_worker_kv_bytes_received_total",
                 "splitserve_worker_failures_total", "splitserve_worker_pages_total"):
        assert metric(cluster, name) > 0, name
    text = httpx.get(cluster.config.url + "/metrics", timeout=10).text
    for wid in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        assert f'splitserve_worker_pages_used{{role="{wid.split("-")[0]}",worker_id="{wid}"}}' in text \
            or f'worker_id="{wid}"' in text
    # Every outcome is exported from the start (at 0): the errors must have counted.
    errors = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith('splitserve_requests_total{outcome="error"}')]
    assert errors and errors[0] > 0
