"""``priority`` at the router's gate, on a launched colocated cluster with one slot
(``--max-inflight-per-worker 1``): while a long request holds the slot and two more wait in the
queue, an urgent request (``priority`` -1) borrows the long one's slot, is answered before the
long one ends and before either waiting one starts, and its greedy text is the one it gets on an
idle cluster; the waiting ones are served afterwards, and no page is held at the end."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from splitserve.launch.local import Cluster
from tests.cluster_config import serve_config
from tests.faults.helpers import (
    assert_no_pages,
    complete,
    metric,
    stream_completion,
    wait_all_healthy,
    wait_until,
)

pytestmark = pytest.mark.slow

PROMPT = "The lighthouse keeper looked at the storm and said"
WAITING = "splitserve_router_queue_waiting"


class Stopped(Exception):
    """Raised from a stream's chunk callback to close it (the client leaves)."""


@pytest.fixture(scope="module")
def cluster(model_path: Path):
    spec = serve_config(model_path, colocated=True, kv_cache_mb=32, threads_per_worker=1,
                        max_inflight_per_worker=1, max_queued_per_worker=4)
    with Cluster(spec) as c:
        wait_all_healthy(c, 1)
        yield c


def test_an_urgent_request_borrows_the_slot_and_passes_the_queue(cluster) -> None:
    url = cluster.config.url
    started, stop = threading.Event(), threading.Event()

    def on_chunk(_res) -> None:
        started.set()
        if stop.is_set():
            raise Stopped

    def long_request():
        try:
            return stream_completion(url, {"model": "default", "prompt": PROMPT,
                                           "max_tokens": 2000,
                                           "ignore_eos": True, "temperature": 0},
                                     on_chunk=on_chunk, timeout_s=600)
        except Stopped:
            return None

    low = {"model": "default", "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    urgent = {"model": "default", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "priority": -1}
    with ThreadPoolExecutor(4) as pool:
        long = pool.submit(long_request)
        wait_until(lambda: started.is_set() or long.done(), 180, "the long request streams")
        assert started.is_set(), long.result()
        waiting = [pool.submit(stream_completion, url, low, None, 300) for _ in range(2)]
        wait_until(lambda: metric(cluster, WAITING) == 2, 60, "two requests waiting")
        r = complete(url, urgent, timeout_s=120)
        # Answered while the long one still holds its slot and both others still wait.
        assert r.status_code == 200, r.text
        assert not long.done() and metric(cluster, WAITING) == 2
        assert all(not f.done() for f in waiting)
        stop.set()  # the long one's client leaves: the waiting ones are admitted
        assert long.result(timeout=120) is None
        served = [f.result(timeout=300) for f in waiting]
    assert [(s.status, s.finish_reason) for s in served] == [(200, "length")] * 2
    idle = complete(url, urgent, timeout_s=120)
    assert idle.status_code == 200
    assert r.json()["choices"][0]["text"] == idle.json()["choices"][0]["text"]
    assert_no_pages(cluster, timeout_s=30)
