"""A router (API server) that restarts: a worker that joined it by URL joins the new one by itself.

Real processes: ``splitserve api-server`` with no static workers, and ``splitserve worker --role
colocated --router URL``. The router is SIGKILLed and started again on the same HTTP port (its
ZeroMQ inbox gets a new port); within a few seconds the worker has re-registered, pointed its
replies at the new inbox and announced itself ready, so requests succeed again. A response the
first router stored (``/v1/responses``, its SQLite store) is served by the second: retrieved,
and continued with ``previous_response_id``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.faults.helpers import wait_until

pytestmark = pytest.mark.slow


def _router(model_path, port: int, store: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "splitserve", "api-server", "--model", str(model_path),
           "--port", str(port), "--responses-store", store]  # fmt: skip
    return subprocess.Popen(cmd, start_new_session=True)


def _completes(url: str) -> bool:
    body = {"model": "default", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    try:
        return httpx.post(url + "/v1/completions", json=body, timeout=20).status_code == 200
    except httpx.HTTPError:
        return False


def test_worker_rejoins_a_restarted_router(model_path, tmp_path) -> None:
    from tests.e2e.conftest import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    store = str(tmp_path / "responses.sqlite3")
    router = _router(model_path, port, store)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    worker = subprocess.Popen(
        [sys.executable, "-m", "splitserve", "worker", "--role", "colocated", "--router", url,
         "--worker-id", "joined-0", "--model", str(model_path), "--kv-cache-mb", "32",
         "--threads", "1"],
        env=env, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(lambda: _completes(url), 180, "a request served through the joined worker")
        made = httpx.post(url + "/v1/responses", timeout=60, json={
            "model": "default", "input": "Remember the word kiwi.", "max_output_tokens": 16})
        assert made.status_code == 200, made.text
        os.killpg(router.pid, signal.SIGKILL)
        router.wait(10)
        router = _router(model_path, port, store)
        wait_until(lambda: _completes(url), 60, "a request served after the router restarted")
        kept = httpx.get(f"{url}/v1/responses/{made.json()['id']}", timeout=10)
        assert kept.status_code == 200 and kept.json() == made.json()
        more = httpx.post(url + "/v1/responses", timeout=60, json={
            "model": "default", "input": "Which word?", "max_output_tokens": 16,
            "previous_response_id": made.json()["id"]})
        assert more.status_code == 200, more.text
        items = httpx.get(f"{url}/v1/responses/{more.json()['id']}/input_items",
                          params={"order": "asc"}, timeout=10).json()["data"]
        assert items[0]["content"][0]["text"] == "Remember the word kiwi."
        rows = httpx.get(url + "/workers", timeout=10).json()
        joined = next(r for r in rows if r["worker_id"] == "joined-0")
        assert joined["healthy"] and joined["role"] == "colocated"
        assert worker.poll() is None  # the worker never stopped
    finally:
        for proc in (worker, router):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
