"""Two API servers (routers) over one pool of workers, as behind a load balancer, and one of
them killed mid-run and restarted.

Real processes on loopback: ``splitserve api-server`` twice (no static workers) and one prefill
and one decode worker started with ``--router A --router B``: each worker reports to both and
takes tasks from both; each request names the router it answers to.

- Shared capacity: the decode worker admits by its own free pages (``Scheduler.can_admit``),
  not by what either router believes, so two routers together offering twice what its pool
  holds get every request served, the rest queued there (seen in its ``num_waiting``), never
  over-committed (``pages_used <= pages_total`` throughout), and every greedy output equals
  the same prompt run alone through one router.
- Router killed: its clients' connections close at once (never a hang); the other router's
  stream goes on untouched; the workers see the dead router's link drop and end its requests
  (``requests_orphaned``), so no page is held for them; the restarted router (same port, new
  inbox) is found by the workers re-registering, and serves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.cluster_config import free_port
from tests.faults.helpers import StreamResult, complete, stream_completion, wait_until

pytestmark = pytest.mark.slow

DEAD_AFTER_S = 3.0
DECODE_KV_MB = 12  # 16 pages of 16 tokens in float32: a few requests at a time
PROMPTS = [f"Write one short sentence about the number {i}." for i in range(8)]


class Pool:
    """Two routers and the workers they share."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self.ports = {"A": free_port(), "B": free_port()}
        self.routers: dict[str, subprocess.Popen] = {}
        self.workers: list[subprocess.Popen] = []

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start_router(self, name: str) -> None:
        self.routers[name] = subprocess.Popen(
            [sys.executable, "-m", "splitserve", "api-server", "--model", str(self.model_path),
             "--port", str(self.ports[name]), "--dead-after", str(DEAD_AFTER_S)],
            start_new_session=True)  # fmt: skip

    def kill_router(self, name: str) -> float:
        """SIGKILL router ``name``; the monotonic time of the kill."""
        proc = self.routers.pop(name)
        killed_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        return killed_at

    def start_workers(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for role, mb in (("prefill", 32), ("decode", DECODE_KV_MB)):
            self.workers.append(subprocess.Popen(
                [sys.executable, "-m", "splitserve", "worker", "--role", role,
                 "--router", self.url("A"), "--router", self.url("B"), "--worker-id", role,
                 "--model", str(self.model_path), "--kv-cache-mb", str(mb), "--threads", "1",
                 "--dtype", "float32"],
                env=env, start_new_session=True))  # fmt: skip

    def rows(self, name: str) -> dict[str, dict]:
        return {r["worker_id"]: r
                for r in httpx.get(self.url(name) + "/workers", timeout=10).json()}

    def healthy(self, name: str) -> bool:
        for p in self.workers:
            assert p.poll() is None, f"a worker exited with {p.returncode}"
        try:
            rows = self.rows(name)
        except httpx.HTTPError:
            return False
        return len(rows) == 2 and all(r["healthy"] for r in rows.values())

    def held(self, name: str) -> dict[str, int]:
        return {k: r["pages_used"] - r.get("cache_evictable_pages", 0)
                for k, r in self.rows(name).items()}

    def close(self) -> None:
        for proc in [*self.workers, *self.routers.values()]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture(scope="module")
def pool(model_path: Path):
    p = Pool(model_path)
    try:
        p.start_router("A")
        p.start_router("B")
        p.start_workers()
        for name in ("A", "B"):
            wait_until(lambda n=name: p.healthy(n), 180, f"both workers healthy at router {name}",
                       interval_s=0.5)
        yield p
    finally:
        p.close()


def _body(prompt: str, max_tokens: int = 16, **extra) -> dict:
    return {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **extra}


def _text(url: str, body: dict) -> str:
    r = complete(url, body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_routers_share_the_decode_pages(pool: Pool) -> None:
    ref = [_text(pool.url("A"), _body(p)) for p in PROMPTS]  # one router, one at a time
    total = pool.rows("A")["decode"]["pages_total"]
    samples: list[dict] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(pool.rows("B")["decode"])
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("A", "B")]
    try:
        with ThreadPoolExecutor(len(jobs)) as ex:
            texts = list(ex.map(lambda j: _text(pool.url(j[0]), _body(PROMPTS[j[1]])), jobs))
    finally:
        stop.set()
        sampler.join()
    for (name, i), text in zip(jobs, texts, strict=True):
        assert text == ref[i], (name, i, text, ref[i])
    assert samples and all(s["pages_total"] == total for s in samples)
    assert max(s["pages_used"] for s in samples) <= total
    # Together the routers offered more than the pool holds: the decode worker queued the rest
    # itself (no router books its pages), and served every request.
    assert any(s["num_waiting"] > 0 for s in samples), "the pool never filled: test too small"
    wait_until(lambda: all(v == 0 for v in pool.held("A").values()), 10, "zero pages held")
    assert pool.held("B") == {"prefill": 0, "decode": 0}


def test_router_killed_mid_run_loses_only_its_requests(pool: Pool) -> None:
    long = _body("Count slowly from one to fifty:", max_tokens=48, ignore_eos=True)
    ref_long = _text(pool.url("B"), long)
    ref_short = _text(pool.url("B"), _body(PROMPTS[0]))
    orphaned = pool.rows("B")["decode"]["requests_orphaned"]
    started = threading.Barrier(4)

    def stream(name: str) -> StreamResult | BaseException:
        seen = threading.Event()

        def on_chunk(r: StreamResult) -> None:
            if r.num_chunks == 3 and not seen.is_set():
                seen.set()
                started.wait(60)

        try:
            return stream_completion(pool.url(name), long, on_chunk, timeout_s=60)
        except httpx.HTTPError as exc:  # the connection closed under it
            exc.ended_at = time.monotonic()  # type: ignore[attr-defined]
            return exc

    with ThreadPoolExecutor(3) as ex:
        on_a = [ex.submit(stream, "A") for _ in range(2)]
        on_b = ex.submit(stream, "B")
        started.wait(60)  # all three streams are decoding
        killed_at = pool.kill_router("A")
        # The workers drop A's requests as soon as A's link drops.
        wait_until(lambda: pool.rows("B")["decode"]["requests_orphaned"] >= orphaned + 2, 60,
                   "the decode worker ended the dead router's two requests", interval_s=0.05)
        freed_s = time.monotonic() - killed_at
        dead = [f.result(timeout=30) for f in on_a]
        res_b = on_b.result(timeout=60)
    for r in dead:  # a closed connection or an error, never a hang or a full answer
        assert isinstance(r, httpx.HTTPError) or r.error is not None or r.finish_reason is None
        # Ended by the closed connection, not by the client's own 60 s read timeout (a hang),
        # and while router B's stream of the same length was still going.
        assert not isinstance(r, httpx.TimeoutException), r
        assert r.ended_at < res_b.ended_at
    assert isinstance(res_b, StreamResult) and res_b.error is None, res_b
    assert res_b.text == ref_long and res_b.finish_reason == "length"  # B's stream untouched
    assert pool.rows("B")["decode"]["requests_orphaned"] == orphaned + 2
    wait_until(lambda: all(v == 0 for v in pool.held("B").values()), 5, "zero pages held")

    pool.start_router("A")
    restarted_at = time.monotonic()
    wait_until(lambda: pool.healthy("A"), 60, "the workers found the restarted router A")
    assert _text(pool.url("A"), _body(PROMPTS[0])) == ref_short
    back_s = time.monotonic() - restarted_at
    assert _text(pool.url("B"), _body(PROMPTS[0])) == ref_short
    assert all(p.poll() is None for p in pool.workers)  # no worker restarted
    wait_until(lambda: all(v == 0 for v in pool.held("A").values()), 10, "zero pages held")
    print(f"\nrouter A SIGKILLed mid-stream: its clients' streams closed within "
          f"{max(r.ended_at for r in dead) - killed_at:.2f} s, the decode worker ended their "
          f"requests {freed_s:.2f} s after the kill; restarted A served {back_s:.2f} s after "
          "its start")
