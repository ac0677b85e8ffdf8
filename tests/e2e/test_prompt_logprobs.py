"""echo + logprobs through launched clusters: prompt logprobs (from the prefill worker when
disaggregated) equal transformers' log_softmax for the default model in float32."""

from __future__ import annotations

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog because it"


@pytest.fixture(scope="module")
def hf_logprobs(hf_model, tokenizer) -> tuple[list[int], list[float]]:
    ids = tokenizer.encode(PROMPT)
    with torch.inference_mode():
        lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    return ids, [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_prompt_logprobs_match_transformers(cluster, hf_logprobs, max_tokens) -> None:
    ids, want = hf_logprobs
    body = {"model": "default", "prompt": PROMPT, "echo": True, "logprobs": 0,
            "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    r = httpx.post(cluster.config.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == ids and choice["text"].startswith(PROMPT)
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == len(ids) + max_tokens and lps[0] is None
    assert max(abs(a - b) for a, b in zip(lps[1 : len(ids)], want)) < 1e-3
    assert all(isinstance(x, float) for x in lps[len(ids):])


def test_logprob_start_len_scores_only_the_tail(cluster, hf_logprobs) -> None:
    _, want = hf_logprobs
    body = {"model": "default", "prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0,
            "logprob_start_len": 6}
    lps = httpx.post(cluster.config.url + "/v1/completions", json=body, timeout=120).json()[
        "choices"][0]["logprobs"]["token_logprobs"]
    assert lps[:6] == [None] * 6
    assert max(abs(a - b) for a, b in zip(lps[6:], want[5:])) < 1e-3
