"""Prompt logprobs (echo/logprobs, ``lang.select``): the scheduler's chunked prefill scores every
prompt token, and the scores equal transformers' ``log_softmax`` for the default model (float32)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams
from tests.engine_core import make_core

pytestmark = pytest.mark.slow

TOL = 1e-3
TEXTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Question: what is two plus two? Answer: four.",
    "Hi",
]


def test_all_logit_rows_follow_sample_rows() -> None:
    b = build_forward_batch([[1, 2, 3], [4, 5]], [0, 4], [[1], [2]], 16, [1], all_logit_seq_indices=[0])
    # The sampled row (sequence 1's last token) first, then every token of sequence 0.
    assert b.logit_indices.tolist() == [4, 0, 1, 2]


def hf_prompt_logprobs(hf_model, ids: list[int]) -> list[float]:
    """Logprob of each token ``ids[1:]`` given the tokens before it."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@pytest.mark.parametrize("max_batch_tokens", [7, 2048])  # 7: prompts split over chunks
def test_prompt_logprobs_match_transformers(model, tokenizer, hf_model, max_batch_tokens):
    torch.set_num_threads(1)
    model, cfg = model
    pool = KVPool(cfg.kv_layout(16, "float32"), 64)
    core = make_core(model, pool, cfg.eos_token_ids, max_batch_tokens=max_batch_tokens)
    sched = core.scheduler
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    starts = [0, 5, 0]
    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=2, temperature=0, logprob_start_len=s))
        for i, (p, s) in enumerate(zip(prompts, starts))
    ]
    plain = Req("plain", prompts[0], SamplingParams(max_new_tokens=2, temperature=0))
    for r in [*reqs, plain]:
        sched.add(r)
    while sched.has_work:
        core.step()
    assert plain.prompt_logprobs == []
    for req, ids, start in zip(reqs, prompts, starts):
        want = hf_prompt_logprobs(hf_model, ids)[max(1, start) - 1 :]
        assert len(req.prompt_logprobs) == len(want), req.rid
        assert max((abs(a - b) for a, b in zip(req.prompt_logprobs, want)), default=0) < TOL
