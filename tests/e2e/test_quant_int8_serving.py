"""``--quantization int8`` served end to end through the ``openai`` client.

- float32, colocated: greedy tokens equal ``transformers`` with the int8 model's de-quantized
  weights (the exact reference; the tie rule of ``test_greedy_vs_hf``).
- bfloat16 (the C int8 products), disaggregated over ZeroMQ: greedy tokens equal the same
  int8 model run in-process one request at a time (same kernels, same step shapes: bfloat16
  sums depend on a step's row count, docs/serving.md "Determinism"), and differ from nothing-quantized
  bfloat16 somewhere (so the served path really is the int8 one).
"""

from __future__ import annotations

import openai
import pytest
import torch

from tests.cpu_kernels import load_or_fail
from tests.e2e.conftest import _launch
from tests.e2e.test_greedy_vs_hf import assert_matches, hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")  # transformers generate here; see conftest

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Write a haiku about rain."]
NEW_TOKENS = 24


def served_greedy(model_path, tokenizer, with_logprobs: bool = False, **engine):
    """Per prompt, the served greedy token ids (with ``with_logprobs``: ``(ids, logprobs)``)."""
    launched = _launch(model_path, quantization="int8", **engine)
    try:
        cluster = next(launched)
        client = openai.OpenAI(base_url=cluster.config.url + "/v1", api_key="none",
                               max_retries=0)
        out = []
        for text in PROMPTS:
            resp = client.completions.create(
                model="default", prompt=text, max_tokens=NEW_TOKENS, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            ids = resp.choices[0].model_extra["token_ids"]
            out.append((ids, resp.choices[0].logprobs.token_logprobs) if with_logprobs else ids)
        return out
    finally:
        launched.close()


def test_float32_int8_served_equals_transformers_on_dequantized_weights(
    model_path, tokenizer
) -> None:
    from transformers import AutoModelForCausalLM

    from tests.engine.test_quant_int8 import _dequantized_hf

    hf = _dequantized_hf(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32))
    reference = hf_greedy(hf.eval(), tokenizer, PROMPTS, NEW_TOKENS)
    got = served_greedy(model_path, tokenizer, colocated=True)
    for (_, ref_new, gaps), ids in zip(reference, got, strict=True):
        # transformers stops at EOS, the served run ignores it: compare up to the reference's
        # end (its last token is then EOS, which the served run must produce too).
        assert_matches(ref_new, gaps, ids[: len(ref_new)])


def _in_process_greedy(model_path, tokenizer, quantization: str):
    """Per prompt, ``(greedy ids, their logprobs)`` from the engine in this process."""
    from splitserve.config import EngineConfig
    from splitserve.engine.kv_pool import KVPool
    from splitserve.engine.model.loader import load_model
    from splitserve.engine.sched.request import Req
    from splitserve.ipc.messages import SamplingParams
    from tests.engine_core import make_core

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run (_launch: one thread each)
    try:
        model, cfg = load_model(model_path, torch.bfloat16,
                                engine=EngineConfig(quantization=quantization))
        out = []
        for text in PROMPTS:
            pool = KVPool(cfg.kv_layout(16, "bfloat16"), 64)
            core = make_core(model, pool, cfg.eos_token_ids)
            params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            req = Req(rid="r", input_ids=tokenizer.encode(text), sampling=params)
            core.scheduler.add(req)
            while core.scheduler.has_work:
                core.step()
            out.append((req.output_ids, req.output_logprobs))
        return out
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(load_or_fail() is None or not load_or_fail().has_w8,
                    reason="no C compiler, or neither AVX512-VNNI nor AVX2")
def test_bf16_int8_served_disaggregated_equals_in_process(model_path, tokenizer) -> None:
    got = served_greedy(model_path, tokenizer, with_logprobs=True, dtype="bfloat16",
                        num_prefill=1, num_decode=1)
    assert all(len(ids) == NEW_TOKENS for ids, _ in got)
    int8 = _in_process_greedy(model_path, tokenizer, "int8")
    none = _in_process_greedy(model_path, tokenizer, "none")
    assert [ids for ids, _ in got] == [ids for ids, _ in int8]
    # Block-of-32 int8 is close enough to bf16 that the greedy tokens may all agree: the
    # logprobs tell the models apart. Served = in-process int8, and int8 != unquantized.
    diff_int8 = max(abs(a - b) for (_, x), (_, y) in zip(got, int8) for a, b in zip(x, y))
    diff_none = max(abs(a - b) for (_, x), (_, y) in zip(got, none) for a, b in zip(x, y))
    assert diff_int8 < 1e-3 < diff_none, (diff_int8, diff_none)
