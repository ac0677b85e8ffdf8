"""Real clusters for end-to-end tests: the default model served by separate processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from splitserve.launch.local import Cluster
from tests.cluster_config import free_port, serve_config

__all__ = ["free_port"]


def _launch(model_path: Path, **kw) -> Iterator[Cluster]:
    # One thread per worker: CI machines have 2 cores shared with pytest and the API server.
    # Stored responses in memory: tests leave nothing in the cache folder.
    options = {"kv_cache_mb": 128, "threads_per_worker": 1, "responses_store": ":memory:", **kw}
    with Cluster(serve_config(model_path, **options)) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def disagg_cluster(model_path: Path) -> Iterator[Cluster]:
    """1 prefill + 1 decode worker, KV over ZeroMQ (tcp on loopback)."""
    yield from _launch(model_path, num_prefill=1, num_decode=1)


@pytest.fixture(scope="session")
def colocated_cluster(model_path: Path) -> Iterator[Cluster]:
    yield from _launch(model_path, colocated=True)


@pytest.fixture(params=["disaggregated", "colocated"])
def cluster(request) -> Cluster:
    name = "disagg_cluster" if request.param == "disaggregated" else "colocated_cluster"
    return request.getfixturevalue(name)


def worker_pages_used(cluster: Cluster) -> dict[str, int]:
    """Pages each worker holds for requests: used pages minus the prefix cache's evictable ones
    (those are a cache, given back on demand, not a leak)."""
    rows = httpx.get(cluster.config.url + "/workers", timeout=10).json()
    return {r["worker_id"]: r["pages_used"] - r["cache_evictable_pages"] for r in rows}


def flush_cache(cluster: Cluster) -> list[dict]:
    """``POST /flush_cache``; the workers' stats after the flush."""
    r = httpx.post(cluster.config.url + "/flush_cache", json={}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def complete_ids(cluster: Cluster, prompt_ids: list[int], max_tokens: int, **kw) -> dict:
    """Non-streaming ``/v1/completions`` on token ids; the choice carries ``token_ids``."""
    body = {"model": "default", "prompt": prompt_ids, "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True, **kw}
    r = httpx.post(cluster.config.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def grammar_cluster(model_path: Path) -> Iterator[Cluster]:
    """1 prefill + 1 decode with KV room for the 70 schema-carrying prompts of
    ``test_every_finished_output_of_70_real_schemas_validates`` at once (~650 tokens each: at
    640 MB they ran in three waves, minutes longer on two cores).

    Module-scoped: its two workers hold ~3.3 GB each (the 2 GB pools are touched at start).
    Kept for the whole session, they and the other clusters left a 24 GB machine 0.7 GB
    available at times during the suite (sampled every 30 s), with the 0.5B models of later
    modules still to load."""
    # The decode side's transfer deadline also covers queueing for prefill, which 70 schema
    # prompts on one CPU thread can exceed at the default 30 s.
    yield from _launch(model_path, num_prefill=1, num_decode=1, kv_cache_mb=2048,
                       transfer_timeout_s=300.0)
