"""The real default model (SmolLM2-135M-Instruct): greedy tokens equal transformers' in float32.

Runs our model on ``$SPLITSERVE_DEVICE`` (default cpu; bench/gpu_check.sh sets cuda, which also
selects the Triton attention backend); the transformers reference stays on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from splitserve.engine.forward_batch import build_forward_batch
from splitserve.engine.kv_pool import KVPool, pages_for
from splitserve.engine.model.loader import load_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

DEVICE = os.environ.get("SPLITSERVE_DEVICE", "cpu")
PAGE_SIZE = 16
NEW_TOKENS = 32
TIE_MARGIN = 1e-4
TEXTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    (
        "Here is a list of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, "
        "53, 59, 61, 67, 71, 73, 79, 83, 89, 97. Now list the next five primes after 97 and explain "
        "how you checked that each of them is prime, step by step, without skipping any number."
    ),
]


def _prompts(tokenizer) -> list[list[int]]:
    out = []
    for i, text in enumerate(TEXTS):
        if i % 2:  # mix raw text and chat-templated prompts
            out.append(tokenizer(text)["input_ids"])
        else:
            msgs = [{"role": "user", "content": text}]
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [list(p) for p in out]


def greedy(model, cfg, prompts: list[list[int]], dtype: str, steps: int) -> list[list[int]]:
    """Batched greedy decoding straight through ``model.forward``: one prefill, then decode."""
    pool = KVPool(cfg.kv_layout(PAGE_SIZE, dtype), 256, DEVICE)
    pages = [pool.allocator.alloc(pages_for(len(p) + steps, PAGE_SIZE)) for p in prompts]
    idx = list(range(len(prompts)))
    batch = build_forward_batch(prompts, [0] * len(prompts), pages, PAGE_SIZE, idx, DEVICE)
    logits = model(batch, pool)
    assert not logits.isnan().any()
    outs = [[t] for t in logits.argmax(-1).tolist()]
    for _ in range(steps - 1):
        lens = [len(p) + len(o) - 1 for p, o in zip(prompts, outs, strict=True)]
        batch = build_forward_batch([[o[-1]] for o in outs], lens, pages, PAGE_SIZE, idx, DEVICE)
        for o, t in zip(outs, model(batch, pool).argmax(-1).tolist(), strict=True):
            o.append(t)
    return outs


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    p = _prompts(tokenizer)
    assert len({len(x) for x in p}) == len(p)  # different lengths
    return p


@pytest.fixture(scope="module")
def f32_model(model_path):
    return load_model(model_path, torch.float32, DEVICE)


def test_greedy_matches_transformers_float32(prompts, f32_model, hf_model) -> None:
    model, cfg = f32_model
    ours = greedy(model, cfg, prompts, "float32", NEW_TOKENS)
    num_compared = 0
    for prompt, mine in zip(prompts, ours, strict=True):
        res = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=cfg.eos_token_ids[0],
        )
        ref = res.sequences[0, len(prompt) :].tolist()
        for pos, (want, got) in enumerate(zip(ref, mine, strict=False)):
            top2 = res.logits[pos][0].float().topk(2).values
            if float(top2[0] - top2[1]) < TIE_MARGIN:
                break  # a near-tie: either token is right, and the continuations diverge
            assert got == want, f"prompt {prompt[:8]}...: token {pos} differs ({got} vs {want})"
            num_compared += 1
    # Guard against a vacuous pass (near-ties are rare: nearly every token gets compared).
    assert num_compared >= len(prompts) * NEW_TOKENS // 2, num_compared


def test_bfloat16_smoke(model_path, tokenizer, f32_model) -> None:
    prompt = tokenizer("The capital of France is")["input_ids"]
    f32, cfg = f32_model
    bf16, _ = load_model(model_path, torch.bfloat16, DEVICE)
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    tokens = greedy(bf16, cfg, [prompt], "bfloat16", 4)[0]
    pool = KVPool(cfg.kv_layout(PAGE_SIZE, "float32"), 8, DEVICE)
    batch = build_forward_batch([prompt], [0], [pool.allocator.alloc(1)], PAGE_SIZE, [0], DEVICE)
    top5 = f32(batch, pool)[0].topk(5).indices.tolist()
    assert tokens[0] in top5, tokenizer.decode(tokens)
