"""Greedy tokens through a launched cluster equal Hugging Face ``transformers`` (float32, the same
weights), colocated and disaggregated. A position where the reference's two best logits are within
1e-4 may legitimately differ (float rounding picks either); comparison stops there."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from tests.e2e.conftest import complete_ids

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a short poem about the ocean and the moon.",
    "def quicksort(arr):\n    \"\"\"Sort a list of integers.\"\"\"\n",
    ("Explain, step by step, why the sky is blue during the day and red at sunset. "
    "Mention Rayleigh scattering, the wavelength of light, and the path length through the "
    "atmosphere. Then give a one-sentence summary for a child."),
]
NEW_TOKENS = 32
TIE_EPS = 1e-4


def hf_greedy(
    hf_model, tokenizer, prompts: list[str], new_tokens: int
) -> list[tuple[list[int], list[int], list[float]]]:
    """Per prompt: (prompt ids, HF greedy ids, gap between HF's two best logits per step)."""
    out = []
    for text in prompts:
        ids = tokenizer.encode(text)
        with torch.inference_mode():
            gen = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                output_scores=True, return_dict_in_generate=True, pad_token_id=0,
            )
        new = gen.sequences[0, len(ids):].tolist()
        gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in gen.scores]
        out.append((ids, new, gaps))
    return out


@pytest.fixture(scope="module")
def reference(hf_model, tokenizer) -> list[tuple[list[int], list[int], list[float]]]:
    return hf_greedy(hf_model, tokenizer, PROMPTS, NEW_TOKENS)


def assert_matches(ref_ids: list[int], gaps: list[float], got: list[int]) -> None:
    for pos, want in enumerate(ref_ids):
        if gaps[pos] < TIE_EPS:
            return  # a near-tie: both choices are right, and the sequences diverge from here
        assert pos < len(got), f"output ended at {pos}, reference has {len(ref_ids)} tokens"
        assert got[pos] == want, f"token {pos}: got {got[pos]}, reference {want} (gap {gaps[pos]:.2e})"
    assert len(got) == len(ref_ids)


def test_greedy_equals_transformers(cluster, reference) -> None:
    for ids, ref_new, gaps in reference:
        body = complete_ids(cluster, ids, NEW_TOKENS)
        assert_matches(ref_new, gaps, body["choices"][0]["token_ids"])


def test_concurrent_requests_equal_alone(cluster, tokenizer) -> None:
    """8 requests of different lengths at once give the tokens each gives alone."""
    prompts = [tokenizer.encode("Tell me about " + "the history of science " * k) for k in range(8)]
    alone = [complete_ids(cluster, p, 24, ignore_eos=True)["choices"][0]["token_ids"] for p in prompts]
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(
            lambda p: complete_ids(cluster, p, 24, ignore_eos=True)["choices"][0]["token_ids"],
            prompts,
        ))
    assert together == alone
