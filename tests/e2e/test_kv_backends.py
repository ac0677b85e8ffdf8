"""Disaggregated clusters over each extra KV transfer backend (zmq is covered by
test_greedy_vs_hf): greedy tokens equal ``transformers`` with prompts prefilled in several chunks,
the transfer metrics show in ``/workers``, a prefill worker killed mid-transfer (shm, nixl) fails
its request and the decode worker frees the pages, and shared-memory segments are gone after the
cluster stops, also when its workers were killed."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from splitserve.config import ServeConfig
from splitserve.kv_transfer.shm_backend import PREFIX, SHM_DIR
from splitserve.launch.local import Cluster
from tests.cluster_config import serve_config
from tests.e2e.conftest import complete_ids, worker_pages_used
from tests.e2e.test_greedy_vs_hf import assert_matches, hf_greedy
from tests.kv_transfer.workers import OPTIONAL_BACKENDS

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    ("Explain, step by step, why the sky is blue during the day and red at sunset. "
     "Mention Rayleigh scattering, the wavelength of light, and the path length through the "
     "atmosphere. Then give a one-sentence summary for a child."),
]
NEW_TOKENS = 16
BACKENDS = ["shm", *OPTIONAL_BACKENDS]


def spec(model_path: Path, backend: str, **kw) -> ServeConfig:
    # max_batch_tokens=16 (one page): the longer prompt is prefilled, and sent, in 4 chunks.
    return serve_config(model_path, kv_cache_mb=64, threads_per_worker=1, max_batch_tokens=16,
                        kv_transfer=backend, **kw)


def segments_of(cluster: Cluster) -> set[str]:
    pids = {str(p.pid) for _, p in cluster.procs}
    return {p.name for p in SHM_DIR.glob(PREFIX + "*") if p.name[len(PREFIX):].split("-")[0] in pids}


def decode_pages_used(cluster: Cluster) -> int:
    rows = httpx.get(cluster.config.url + "/workers", timeout=10).json()
    return next(r["pages_used"] for r in rows if r["role"] == "decode")


@pytest.fixture(scope="module")
def reference(hf_model, tokenizer) -> list[tuple[list[int], list[int], list[float]]]:
    return hf_greedy(hf_model, tokenizer, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_equals_transformers(model_path, reference, backend) -> None:
    with Cluster(spec(model_path, backend)) as cluster:
        names = segments_of(cluster)
        assert len(names) == (backend == "shm")  # the decode worker's pool
        for ids, ref_new, gaps in reference:
            body = complete_ids(cluster, ids, NEW_TOKENS)
            assert_matches(ref_new, gaps, body["choices"][0]["token_ids"])
        rows = httpx.get(cluster.config.url + "/workers", timeout=10).json()
        by_role = {r["role"]: r for r in rows}
        assert by_role["prefill"]["kv_transfer"] == by_role["decode"]["kv_transfer"] == backend
        assert by_role["prefill"]["kv_messages_sent"] > len(PROMPTS)  # several chunks each
        assert by_role["decode"]["kv_bytes_received"] == by_role["prefill"]["kv_bytes_sent"] > 0
        assert by_role["decode"]["kv_gbps"] > 0
        assert set(worker_pages_used(cluster).values()) == {0}
    assert not {p.name for p in SHM_DIR.glob(PREFIX + "*")} & names


@pytest.mark.parametrize("backend", ["shm", BACKENDS[-1]])
def test_killed_workers_free_pages_and_leave_no_shm_segments(model_path, tokenizer, backend) -> None:
    """SIGKILL the prefill worker while a long prompt is in flight: the request ends with an
    error and the decode worker frees its pages; SIGKILL the decode worker: its shm segment (if
    any) is removed when the cluster stops."""
    cluster = Cluster(spec(model_path, backend, transfer_timeout_s=3.0)).start()
    try:
        pids = {name: proc.pid for name, proc in cluster.procs}
        names = segments_of(cluster)
        assert len(names) == (backend == "shm")
        ids = tokenizer.encode("Tell me about the history of science. " * 60)  # ~480 tokens
        body = {"model": "default", "prompt": ids, "max_tokens": 4, "temperature": 0}
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(httpx.post, cluster.config.url + "/v1/completions", json=body,
                              timeout=60)
            time.sleep(1.0)  # prefill is under way, chunk by chunk
            os.kill(pids["prefill-0"], signal.SIGKILL)
            r = fut.result()
        assert r.status_code >= 500, r.text
        deadline = time.monotonic() + 15
        while decode_pages_used(cluster) != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert decode_pages_used(cluster) == 0
        os.kill(pids["decode-0"], signal.SIGKILL)
        time.sleep(0.5)
        assert {p.name for p in SHM_DIR.glob(PREFIX + "*")} >= names  # a killed owner leaves it
    finally:
        cluster.stop()
    assert not {p.name for p in SHM_DIR.glob(PREFIX + "*")} & names
