"""A router (API server) that restarts: a worker that joined it by URL joins the new one by itself.

Real processes: ``splitserve api-server`` with no static workers, and ``splitserve worker --role
colocated --router URL``. The router is SIGKILLed and started again on the same HTTP port (its
ZeroMQ inbox gets a new port); within a few seconds the worker has re-registered, pointed its
replies at the new inbox and announced itself ready, so requests succeed again.
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


def _router(model_path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "splitserve", "api-server", "--model", str(model_path),
           "--port", str(port)]  # fmt: skip
    return subprocess.Popen(cmd, start_new_session=True)


def _completes(url: str) -> bool:
    body = {"model": "default", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    try:
        return httpx.post(url + "/v1/completions", json=body, timeout=20).status_code == 200
    except httpx.HTTPError:
        return False


def test_worker_rejoins_a_restarted_router(model_path) -> None:
    from tests.e2e.conftest import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = _router(model_path, port)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    worker = subprocess.Popen(
        [sys.executable, "-m", "splitserve", "worker", "--role", "colocated", "--router", url,
         "--worker-id", "joined-0", "--model", str(model_path), "--kv-cache-mb", "32",
         "--threads", "1"],
        env=env, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(lambda: _completes(url), 180, "a request served through the joined worker")
        os.killpg(router.pid, signal.SIGKILL)
        router.wait(10)
        router = _router(model_path, port)
        wait_until(lambda: _completes(url), 60, "a request served after the router restarted")
        rows = httpx.get(url + "/workers", timeout=10).json()
        joined = next(r for r in rows if r["worker_id"] == "joined-0")
        assert joined["healthy"] and joined["role"] == "colocated"
        assert worker.poll() is None  # the worker never stopped
    finally:
        for proc in (worker, router):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
