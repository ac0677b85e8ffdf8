"""Real GGUF files as ``--model``, served end to end: Gemma-3-270M (Q4_K_M: Q4_K/Q6_K/Q5_0/Q8_0
tensors, sliding-window layers, no chat template in the file) and Qwen2.5-Coder-0.5B-Instruct
(Q5_0/Q8_0/Q4_K/Q6_K, its own chat template). Greedy float32 tokens, colocated and
disaggregated, equal ``transformers`` loading the same GGUF file (``gguf_file=``), with the tie
rule of ``test_greedy_vs_hf.py``.

The files come from PyPI wheels (``splitserve.wheel_models``; the dev extra installs them); the
tests skip, saying what to install, where they are absent. Slow (each worker de-quantizes the
file with gguf's numpy readers): a few minutes per model on 2 cores.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from splitserve.default_model import resolve_model_path
from splitserve.launch.local import Cluster
from splitserve.wheel_models import gemma3_270m_gguf, qwen25_coder_05b_gguf
from tests.cluster_config import serve_config
from tests.e2e.conftest import complete_ids
from tests.e2e.test_greedy_vs_hf import assert_matches

# The HF reference alone de-quantizes the file for minutes on a busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

MODELS: dict[str, Callable[[], Path]] = {
    "gemma3_270m": gemma3_270m_gguf,
    "qwen25_coder_05b": qwen25_coder_05b_gguf,
}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]
CHAT = [{"role": "user", "content": "Name three primary colors."}]
NEW_TOKENS = 12
START_TIMEOUT_S = 900.0  # every worker de-quantizes the whole file (gguf's numpy readers)


class Served:
    """One model's GGUF file, its folder (what ``--model file.gguf`` resolves to), and the
    reference: per prompt (prompt ids, HF greedy ids, HF's top-2 logit gaps)."""

    def __init__(self, gguf: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.gguf = gguf
        self.folder = resolve_model_path(str(gguf))
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        hf = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        chat_ids = self.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
        if not isinstance(chat_ids, list):  # transformers 5 returns a BatchEncoding
            chat_ids = chat_ids["input_ids"]
        self.chat_ids: list[int] = list(chat_ids)
        prompts = [self.tokenizer.encode(p) for p in PROMPTS]
        self.reference = [(ids, *_hf_greedy(hf, ids)) for ids in [*prompts, self.chat_ids]]
        del hf
        gc.collect()  # the workers need the memory


def _hf_greedy(hf, ids: list[int]) -> tuple[list[int], list[float]]:
    """``NEW_TOKENS`` greedy tokens of ``hf`` after ``ids`` (whole sequence each step, no stop
    at EOS: the server is asked with ``ignore_eos``), and the gap between the two best logits
    at each step."""
    seq, gaps = list(ids), []
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            top = hf(torch.tensor([seq])).logits[0, -1].topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            seq.append(int(top.indices[0]))
    return seq[len(ids):], gaps


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request) -> Served:
    try:
        gguf = MODELS[request.param]()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return Served(gguf)


def _chat(cluster: Cluster, messages: list[dict]) -> dict:
    body = {"model": "default", "messages": messages, "max_tokens": NEW_TOKENS,
            "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    r = httpx.post(cluster.config.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_gguf_served_equals_transformers(served: Served, mode: str) -> None:
    shape = {"colocated": True} if mode == "colocated" else {"num_prefill": 1, "num_decode": 1}
    # A worker stepping a 0.5B float32 model on a starved CPU can miss heartbeats for seconds
    # (seen: the colocated run's first request got 503 at load 27 on 2 cores): allow a minute.
    config = serve_config(served.folder, kv_cache_mb=64, threads_per_worker=1,
                          dead_after_s=60.0, **shape)
    cluster = Cluster(config).start(timeout_s=START_TIMEOUT_S)
    try:
        models = httpx.get(config.url + "/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == served.gguf.stem  # the served name is the file's
        *texts, (chat_ids, chat_new, chat_gaps) = served.reference
        for ids, ref_new, gaps in texts:
            body = complete_ids(cluster, ids, NEW_TOKENS, ignore_eos=True)
            assert_matches(ref_new, gaps, body["choices"][0]["token_ids"])
        # Chat: the server renders the folder's template (the file's, or Gemma's own where the
        # file has none) to the ids the reference was given.
        chat = _chat(cluster, CHAT)
        assert chat["usage"]["prompt_tokens"] == len(chat_ids)
        assert_matches(chat_new, chat_gaps, chat["choices"][0]["token_ids"])
    finally:
        cluster.stop()
