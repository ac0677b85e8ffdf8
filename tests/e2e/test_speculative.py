"""``--speculative ngram`` through a launched disaggregated cluster (the decode worker drafts and
verifies; the prefill worker's radix cache on): greedy tokens equal ``transformers`` float32
(the tie rule of ``test_greedy_vs_hf``), drafts are kept on text that copies its prompt, a
constrained request still validates, and every page comes back."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from splitserve.launch.local import Cluster
from tests.cluster_config import serve_config
from tests.e2e.conftest import complete_ids, flush_cache, worker_pages_used
from tests.e2e.test_greedy_vs_hf import assert_matches, hf_greedy

CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
    CODE,
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def spec_cluster(model_path: Path) -> Iterator[Cluster]:
    config = serve_config(model_path, num_prefill=1, num_decode=1, kv_cache_mb=64,
                          threads_per_worker=1, speculative="ngram", num_speculative_tokens=4)
    with Cluster(config) as cluster:
        yield cluster


def _decode_counters(cluster: Cluster) -> tuple[int, int]:
    rows = httpx.get(cluster.config.url + "/workers", timeout=10).json()
    (row,) = [r for r in rows if r["role"] == "decode"]
    return row["spec_draft_tokens"], row["spec_accepted_tokens"]


def test_speculative_greedy_equals_transformers(spec_cluster, hf_model, tokenizer) -> None:
    reference = hf_greedy(hf_model, tokenizer, PROMPTS, NEW_TOKENS)
    before = _decode_counters(spec_cluster)
    # Concurrently: rows with and without drafts share steps.
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        bodies = list(pool.map(lambda ref: complete_ids(spec_cluster, ref[0], NEW_TOKENS),
                               reference))
    for (_, ref_new, gaps), body in zip(reference, bodies, strict=True):
        assert_matches(ref_new, gaps, body["choices"][0]["token_ids"])
    drafted, accepted = (a - b for a, b in zip(_decode_counters(spec_cluster), before))
    assert accepted > 0 and drafted >= accepted, (drafted, accepted)


def test_constrained_request_under_speculation(spec_cluster) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}
    body = {"model": "default", "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": "Alice is 30. Give her as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": schema}}}
    r = httpx.post(spec_cluster.config.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    import json

    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)


def test_no_pages_held_after_speculation(spec_cluster) -> None:
    flush_cache(spec_cluster)
    assert set(worker_pages_used(spec_cluster).values()) == {0}
