"""Prefix-cache tiers through launched clusters and the real model: whichever tier a hit comes
from (the pool, host memory, disk, the shared Mooncake Store), the greedy tokens are
``transformers``' (float32), colocated and disaggregated; a restarted worker serves its old
prefixes from disk; a corrupted or truncated block, a full disk and a store that went away each
cost a recompute and a counter; two prefill workers share a prefix through a real
``mooncake_master``; tenants never share.

Pools are a few pages so that a handful of prompts push a prefix down the tiers. One cluster per
configuration, shared by the module's tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from splitserve.launch.local import Cluster
from splitserve.radix_cache.block_hash import block_keys, chain_root
from tests.cluster_config import serve_config
from tests.e2e.test_greedy_vs_hf import assert_matches, hf_greedy
from tests.faults.helpers import wait_all_healthy, wait_until, workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NEW_TOKENS = 8
# ~130 tokens: 8 blocks of 16; a pool of 12 MiB holds 16 pages of float32 SmolLM2 KV.
PROMPT = ("You are a careful assistant. Answer in one sentence. Facts: the Nile is the longest "
          "river in Africa; Mount Everest is the highest mountain above sea level; the Pacific is "
          "the largest ocean; Canberra is the capital of Australia; water boils at 100 degrees "
          "Celsius at sea level; the Moon orbits the Earth about once every 27 days; the "
          "speed of light is about 300,000 kilometres per second.\nQ: Which ocean is largest?\nA:")
OTHERS = [f"Story {i}: " + "A traveller walked along the river, counting stones and birds. " * 14
          for i in range(4)]  # ~200 tokens each: one pushes the prompt out of the pool
POOL_MB, HOST_MB = 12, 16  # 22 blocks of L2: the prompt (6) and one other (11), not two


def _complete(cluster: Cluster, ids: list[int], **kw) -> tuple[list[int], int, dict[str, int]]:
    """Greedy completion of ``ids``: (tokens, cached tokens, cached tokens per tier)."""
    body = {"model": "default", "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0,
            "return_token_ids": True, **kw}
    r = httpx.post(cluster.config.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    parts = dict(p.strip().split("=") for p in r.headers["x-splitserve-cached-tokens"].split(";"))
    total = int(parts.pop("total"))
    assert total == r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return r.json()["choices"][0]["token_ids"], total, {t: int(n) for t, n in parts.items() if
                                                       int(n)}


@pytest.fixture(scope="module")
def reference(hf_model, tokenizer) -> tuple[list[int], list[int], list[float]]:
    return hf_greedy(hf_model, tokenizer, [PROMPT], NEW_TOKENS)[0]


@pytest.fixture(scope="class")
def colocated(model_path: Path, tmp_path_factory) -> Iterator[Cluster]:
    """Colocated, L2 + L3, write-through (the disk has every block: restarts)."""
    disk = tmp_path_factory.mktemp("l3-colocated")
    cfg = serve_config(model_path, colocated=True, kv_cache_mb=POOL_MB, threads_per_worker=1,
                       kv_host_cache_mb=HOST_MB, kv_disk_cache_dir=str(disk),
                       kv_cache_write_policy="write_through")
    with Cluster(cfg) as cluster:
        yield cluster


@pytest.fixture
def disaggregated(model_path: Path, tmp_path_factory) -> Iterator[Cluster]:
    """1 prefill + 1 decode, the prefill worker with L2 + L3, write-back."""
    disk = tmp_path_factory.mktemp("l3-disagg")
    cfg = serve_config(model_path, num_prefill=1, num_decode=1, kv_cache_mb=POOL_MB,
                       threads_per_worker=1, kv_host_cache_mb=HOST_MB,
                       kv_disk_cache_dir=str(disk), kv_cache_write_policy="write_back")
    with Cluster(cfg) as cluster:
        yield cluster


def _walk_down_the_tiers(cluster: Cluster, tokenizer, reference) -> list[dict[str, int]]:
    """Ask for the prompt cold, again (the pool has it), after one other prompt pushed it out of
    the pool (host memory has it), and after three more pushed it out of host memory (the disk
    has it); every answer is the reference's. Returns each warm answer's cached tokens by tier."""
    ids, ref_new, gaps = reference
    got, cached, _ = _complete(cluster, ids)
    assert_matches(ref_new, gaps, got)
    seen = []
    for others in ([], OTHERS[:1], OTHERS[1:4]):
        for other in others:
            _complete(cluster, tokenizer.encode(other))
        got, cached, by_tier = _complete(cluster, ids)
        assert_matches(ref_new, gaps, got)
        assert cached == (len(ids) - 1) // 16 * 16 and sum(by_tier.values()) == cached
        seen.append(by_tier)
    return seen


def _check_every_tier(cluster: Cluster, tokenizer, reference) -> None:
    full = (len(reference[0]) - 1) // 16 * 16
    assert _walk_down_the_tiers(cluster, tokenizer, reference) == [
        {"l1": full}, {"l2": full}, {"l3": full}]
    rows = [r for r in workers(cluster).values() if r["role"] != "decode"]
    tiers = {t["tier"]: t for t in rows[0]["cache_tiers"]}
    assert tiers["l3"]["hit_tokens"] > 0 and tiers["l3"]["load_bytes"] > 0
    assert tiers["l2"]["load_blocks"] > 0 and tiers["l3"]["corrupt_blocks"] == 0
    metrics = httpx.get(cluster.config.url + "/metrics", timeout=10).text
    assert 'splitserve_cached_prompt_tokens_total{tier="l3"}' in metrics
    assert 'splitserve_cache_tier_hit_tokens_total{' in metrics


def test_disaggregated_every_tier_serves_the_reference_tokens(disaggregated, tokenizer,
                                                             reference) -> None:
    _check_every_tier(disaggregated, tokenizer, reference)


def _block_path(cluster: Cluster, ids: list[int], i: int) -> Path:
    """The L3 file of block ``i`` of prompt ``ids`` (shared namespace)."""
    root = Path(cluster.config.engine.kv_disk_cache_dir)
    (identity,) = [d.name for d in root.iterdir() if d.is_dir()]
    key = block_keys(chain_root(identity, None), ids, cluster.config.engine.page_size)[i]
    return root / identity / key[:2] / f"{key}.kv"


class TestColocated:
    """One colocated cluster (L2 + L3, write-through) for both tests, in order."""

    def test_every_tier_serves_the_reference_tokens(self, colocated, tokenizer,
                                                    reference) -> None:
        _check_every_tier(colocated, tokenizer, reference)

    def test_restart_serves_old_prefixes_and_damaged_blocks_are_recomputed(
                self, colocated, tokenizer, hf_model) -> None:
        """Three prompts cached; one block of one corrupted, one of another truncated; the worker
        killed and restarted with the same disk: the intact prompt comes from disk whole, the two
        damaged ones up to their damaged block, every answer the reference's."""
        texts = [f"Document {k}. " + "Facts about rivers, mountains and oceans, in order. " * 9
                 for k in range(3)]
        refs = hf_greedy(hf_model, tokenizer, texts, NEW_TOKENS)
        for ids, _, _ in refs:
            _complete(colocated, ids)
        (a, _, _), (b, _, _) = refs[0], refs[1]
        corrupt, cut = _block_path(colocated, a, 2), _block_path(colocated, b, 3)
        data = bytearray(corrupt.read_bytes())
        data[len(data) // 2] ^= 0x40
        corrupt.write_bytes(bytes(data))
        cut.write_bytes(cut.read_bytes()[:1000])

        colocated.kill("colocated-0")
        colocated.restart("colocated-0")
        wait_all_healthy(colocated, 1)
        expect = [2 * 16, 3 * 16, None]  # blocks before the damaged one; the intact prompt whole
        for (ids, ref_new, gaps), want in zip(refs, expect, strict=True):
            got, cached, by_tier = _complete(colocated, ids)
            assert_matches(ref_new, gaps, got)
            full = (len(ids) - 1) // 16 * 16
            assert cached == (full if want is None else want) and by_tier == {"l3": cached}
            assert cached >= 0.9 * len(ids) if want is None else True
        (row,) = workers(colocated).values()
        tiers = {t["tier"]: t for t in row["cache_tiers"]}
        assert tiers["l3"]["corrupt_blocks"] == 2
        # Another tenant's salt finds nothing in any tier, though every tier holds the prompt.
        _, cached, _ = _complete(colocated, refs[2][0], cache_salt="another-tenant")
        assert cached == 0


# ---- two prefill workers, one Mooncake Store; a full disk; the store going away ---------------


@pytest.fixture(scope="class")
def small_disk() -> Iterator[Path]:
    """A 256 KiB tmpfs (root only): the disk tier fills after a few blocks. Without root, an
    ordinary directory (the disk-full assertions are skipped)."""
    root = Path(tempfile.mkdtemp())
    mounted = os.geteuid() == 0 and shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)], check=False,
        capture_output=True).returncode == 0
    try:
        yield root if mounted else root / "plain"
    finally:
        if mounted:
            subprocess.run(["umount", str(root)], check=False)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="class")
def shared_store(model_path: Path, small_disk: Path) -> Iterator[Cluster]:
    pytest.importorskip("mooncake.store", reason="needs the mooncake extra")
    cfg = serve_config(model_path, num_prefill=2, num_decode=1, kv_cache_mb=POOL_MB,
                       threads_per_worker=1, kv_store="local", kv_store_segment_mb=64,
                       kv_disk_cache_dir=str(small_disk), routing="round_robin")
    with Cluster(cfg) as cluster:
        yield cluster


class TestSharedStore:
    """Two prefill workers (round robin), one decode worker, a local mooncake_master and a
    small disk: the store shares a prefix; then the master is killed."""

    def test_two_prefill_workers_share_a_prefix_through_the_store(
                self, shared_store, small_disk, reference) -> None:
        ids, ref_new, gaps = reference
        first, cached, _ = _complete(shared_store, ids)  # computed on one prefill worker
        assert cached == 0
        assert_matches(ref_new, gaps, first)
        blocks = (len(ids) - 1) // 16

        def stored() -> bool:  # the store is written behind the request: wait for its writes
            rows = [r for r in workers(shared_store).values() if r["role"] == "prefill"]
            return sum({t["tier"]: t for t in r["cache_tiers"]}["store"]["write_blocks"]
                       for r in rows) >= blocks

        wait_until(stored, 120, f"{blocks} blocks written to the store")
        got, cached, by_tier = _complete(shared_store, ids)  # round robin: the other one
        assert_matches(ref_new, gaps, got)
        assert cached == (len(ids) - 1) // 16 * 16 and by_tier.get("store", 0) > 0, by_tier
        rows = [r for r in workers(shared_store).values() if r["role"] == "prefill"]
        store_rows = [{t["tier"]: t for t in r["cache_tiers"]}["store"] for r in rows]
        assert sum(s["load_blocks"] for s in store_rows) > 0
        assert sum(s["write_blocks"] for s in store_rows) > 0
        if small_disk.name != "plain":  # a 256 KiB disk: most of the prompt's blocks did not fit
            disk_rows = [{t["tier"]: t for t in r["cache_tiers"]}["l3"] for r in rows]
            assert sum(d["write_errors"] for d in disk_rows) > 0

    def test_a_store_that_went_away_costs_a_recompute(self, shared_store, tokenizer,
                                                      hf_model) -> None:
        text = "The store is gone now. " + "Rivers run to the sea and the sea runs to the sky. " * 9
        ((ids, ref_new, gaps),) = hf_greedy(hf_model, tokenizer, [text], NEW_TOKENS)
        shared_store.store.kill()
        shared_store.store.wait()
        for _ in range(3):  # each prefill worker, then one of them again: nothing fails
            got, _, by_tier = _complete(shared_store, ids)
            assert_matches(ref_new, gaps, got)
            assert "store" not in by_tier
        rows = [r for r in workers(shared_store).values() if r["role"] == "prefill"]
        store_rows = [{t["tier"]: t for t in r["cache_tiers"]}["store"] for r in rows]
        assert sum(s["write_errors"] + s["unavailable"] for s in store_rows) > 0
