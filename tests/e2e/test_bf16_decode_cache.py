"""bfloat16 (the served dtype on CPUs with avx512_bf16 or AMX) through a disaggregated cluster:
the decode worker's decode KV cache, filled from pages that arrived by KV transfer, gives the same
greedy tokens as the gather path it replaces (``SPLITSERVE_DECODE_KV_CACHE=0``)."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.conftest import _launch, complete_ids, worker_pages_used

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Explain, step by step, why the sky is blue during the day and red at sunset. " * 3,
]


def _tokens(model_path: Path, tokenizer, use_cache: bool) -> list[list[int]]:
    # Kernels pinned: under "auto" each cluster times its plan at start-up and may hand a step
    # size to another kernel, whose bf16 rounding differs (a numerics test must not race that).
    launched = _launch(model_path, num_prefill=1, num_decode=1, dtype="bfloat16",
                       decode_kv_cache=use_cache, kernels="c")
    try:
        cluster = next(launched)
        out = [
            complete_ids(cluster, tokenizer.encode(p), 20, ignore_eos=True)["choices"][0][
                "token_ids"
            ]
            for p in PROMPTS
        ]
        assert all(n == 0 for n in worker_pages_used(cluster).values())
        return out
    finally:
        launched.close()  # stops the cluster


def test_decode_cache_tokens_equal_gather_path(model_path, tokenizer) -> None:
    with_cache = _tokens(model_path, tokenizer, use_cache=True)
    assert all(len(t) == 20 for t in with_cache)
    assert with_cache == _tokens(model_path, tokenizer, use_cache=False)
