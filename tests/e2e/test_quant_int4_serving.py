"""``--quantization int4`` served end to end through the ``openai`` client, on the default model.

- float32, colocated: greedy tokens equal ``transformers`` with the int4 model's de-quantized
  weights (the exact reference; the tie rule of ``test_greedy_vs_hf``).
- bfloat16 (the int4 decode kernels the plan picks), disaggregated over ZeroMQ: the output need
  not equal either reference token for token (x is quantized to int8 per group inside the
  kernel, bfloat16 rounds), so it is held to being the de-quantized float32 model's own choice:
  scored by that model on the served sequence itself (teacher-forced), every served token is
  within a small log-probability gap of that model's best token at its position. Garbage, or
  another model's tokens, fail this by several nats.
- ``--quantization int3`` is refused at launch, naming the flag and the valid choices.
"""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
import torch

from tests.cpu_kernels import load_or_fail
from tests.e2e.conftest import _launch
from tests.e2e.test_greedy_vs_hf import assert_matches, hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Write a haiku about rain."]
NEW_TOKENS = 24
MAX_GAP = 1.5  # nats: a served token's log-probability below the reference model's best
MEAN_GAP = 0.15


def served_greedy(model_path, **engine) -> list[list[int]]:
    launched = _launch(model_path, quantization="int4", **engine)
    try:
        cluster = next(launched)
        client = openai.OpenAI(base_url=cluster.config.url + "/v1", api_key="none",
                               max_retries=0)
        out = []
        for text in PROMPTS:
            resp = client.completions.create(
                model="default", prompt=text, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            out.append(resp.choices[0].model_extra["token_ids"])
        return out
    finally:
        launched.close()


@pytest.fixture(scope="module")
def dequantized_hf(model_path):
    from transformers import AutoModelForCausalLM

    from tests.engine.test_quant_int4 import dequantized_hf

    return dequantized_hf(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)).eval()


def test_float32_int4_served_equals_transformers_on_dequantized_weights(
    model_path, tokenizer, dequantized_hf
) -> None:
    reference = hf_greedy(dequantized_hf, tokenizer, PROMPTS, NEW_TOKENS)
    got = served_greedy(model_path, colocated=True)
    for (_, ref_new, gaps), ids in zip(reference, got, strict=True):
        # generate() stops at EOS, the served run ignores it: compare the reference's tokens.
        assert_matches(ref_new, gaps, ids[: len(ref_new)])


def _gaps(hf, prompt_ids: list[int], new_ids: list[int]) -> list[float]:
    """Per served token: the reference's best log-probability minus the served token's, with
    the served sequence as the context (teacher-forced)."""
    seq = torch.tensor([prompt_ids + new_ids])
    with torch.inference_mode():
        logp = torch.log_softmax(hf(seq).logits[0].double(), -1)
    rows = logp[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(new_ids)]
    chosen = rows[torch.arange(len(new_ids)), torch.tensor(new_ids)]
    return (rows.max(-1).values - chosen).tolist()


@pytest.mark.skipif(load_or_fail() is None or not load_or_fail().has_w4,
                    reason="no C compiler or no AVX512-VNNI")
def test_bf16_int4_served_disaggregated_is_the_dequantized_models_choice(
    model_path, tokenizer, dequantized_hf
) -> None:
    got = served_greedy(model_path, dtype="bfloat16", num_prefill=1, num_decode=1)
    gaps = []
    for text, ids in zip(PROMPTS, got, strict=True):
        assert len(ids) == NEW_TOKENS
        gaps += _gaps(dequantized_hf, tokenizer.encode(text), ids)
    assert max(gaps) < MAX_GAP, gaps
    assert sum(gaps) / len(gaps) < MEAN_GAP, gaps
    # The check can fail: the same tokens shifted by one (plausible text, wrong positions)
    # score far worse.
    shifted = _gaps(dequantized_hf, tokenizer.encode(PROMPTS[0]), got[0][1:] + got[0][:1])
    assert sum(shifted) / len(shifted) > 5 * MEAN_GAP


def test_launch_refuses_an_unknown_quantization(tmp_path) -> None:
    env = {"SPLITSERVE_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "splitserve", "serve", "--quantization", "int3", "--port", "0"],
        check=False, capture_output=True, text=True, timeout=120, env=env,
    )
    assert run.returncode != 0
    assert "--quantization" in run.stderr and "'int3'" in run.stderr, run.stderr
    assert "int4" in run.stderr and "Traceback" not in run.stderr, run.stderr
