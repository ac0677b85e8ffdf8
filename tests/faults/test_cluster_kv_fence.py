"""A shared-memory cluster whose prefill worker hangs (SIGSTOP) mid-transfer: the router declares
it dead and aborts the request, and the decode worker keeps the request's pages out of use for as
long as the prefill worker could still write into them — well past the fixed 3 s quarantine this
replaced — then frees them as soon as the prefill worker, resumed, acknowledges. Zero pages in
use afterwards."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from splitserve.launch.local import Cluster
from tests.cluster_config import serve_config
from tests.faults.helpers import assert_no_pages, complete, wait_all_healthy, wait_until, workers

pytestmark = pytest.mark.slow

OLD_QUARANTINE_S = 3.0
DEAD_AFTER_S = 2.0
PROMPT_LEN = 1600


@pytest.fixture(scope="module")
def cluster(model_path: Path):
    # Chunks of 32 tokens: the prompt is sent in many early chunks. The transfer timeout (the
    # fence's fallback) is far longer than the test.
    spec = serve_config(model_path, kv_cache_mb=160, threads_per_worker=1, max_batch_tokens=32,
                        kv_transfer="shm", dead_after_s=DEAD_AFTER_S, transfer_timeout_s=60)
    with Cluster(spec) as c:
        wait_all_healthy(c, 2)
        yield c


def decode_row(cluster: Cluster) -> dict:
    return next(r for r in workers(cluster).values() if r["role"] == "decode")


def test_hung_prefill_keeps_pages_fenced_until_it_acknowledges(cluster) -> None:
    body = {"model": "default", "prompt": list(range(1000, 1000 + PROMPT_LEN)), "max_tokens": 4,
            "temperature": 0}
    pid = cluster.proc("prefill-0").pid
    received_before = decode_row(cluster)["kv_pages_received"]
    result = {}
    client = threading.Thread(target=lambda: result.update(r=complete(cluster.config.url, body)))
    client.start()
    stopped = False
    try:
        wait_until(lambda: decode_row(cluster)["kv_pages_received"] > received_before, 60,
                   "an early chunk at the decode worker", interval_s=0.05)
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        client.join(DEAD_AFTER_S + 10)  # the router declares prefill-0 dead: 503, aborted
        assert result["r"].status_code == 503, result["r"].text
        time.sleep(OLD_QUARANTINE_S + 1)
        row = decode_row(cluster)
        assert row["pages_used"] == -(-PROMPT_LEN // 16), row  # the reservation, still fenced
        assert row["num_transferring"] == 0  # no longer waiting for its KV
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
    assert_no_pages(cluster, timeout_s=5)  # the acknowledgement came: pages freed
    wait_all_healthy(cluster, 2)
