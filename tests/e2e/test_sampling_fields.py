"""The sampling fields and logprobs through launched clusters, against ``transformers`` (float32):
each penalty, ``logit_bias`` and ``min_tokens``/``stop_token_ids`` on both endpoints, sent at
once so the workers batch rows with different params, equal to the reference step by step and
equal colocated and disaggregated; chat ``top_logprobs`` (first token from the prefill worker,
the rest from the decode worker) and completions ``logprobs`` with ``echo`` equal to HF's
log-softmax within 1e-3, of the raw distribution even under a penalty; several prompts in one
request; lm-evaluation-harness's own ``local-completions`` loglikelihood."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from splitserve.ipc.messages import SamplingParams
from tests.e2e.conftest import worker_pages_used
from tests.sampling_reference import hf_greedy, hf_logprobs

pytestmark = pytest.mark.slow

TOL = 1e-3
PROMPT = "one two one two one two one two one two one two"
NUM_TOKENS = 6


def _post(cluster, path: str, body: dict) -> dict:
    r = httpx.post(cluster.config.url + path, json={"model": "default", **body}, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def cases(tokenizer, hf_model, model_path) -> list[tuple[dict, list[int]]]:
    """(request fields, HF greedy token ids) per case; each case changes the plain output."""
    from splitserve.engine.model.config import ModelConfig

    eos = ModelConfig.from_dir(model_path).eos_token_ids
    prompt = tokenizer.encode(PROMPT)
    plain = hf_greedy(hf_model, prompt, SamplingParams(temperature=0), NUM_TOKENS, eos)
    fields = [
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 2.0},
        # The first token (sampled on the prefill worker when disaggregated) is banned.
        {"logit_bias": {str(plain[0]): -100, str(tokenizer.encode(" three")[0]): 6}},
        {"stop_token_ids": [plain[1]], "min_tokens": 3},
    ]
    out = []
    for f in fields:
        params = SamplingParams(
            temperature=0, frequency_penalty=f.get("frequency_penalty", 0.0),
            presence_penalty=f.get("presence_penalty", 0.0),
            repetition_penalty=f.get("repetition_penalty", 1.0),
            logit_bias={int(k): float(v) for k, v in f.get("logit_bias", {}).items()},
            stop_token_ids=f.get("stop_token_ids", []), min_tokens=f.get("min_tokens", 0),
        )
        want = hf_greedy(hf_model, prompt, params, NUM_TOKENS, eos)
        assert want != plain, f"{f} does not change the output: the case would prove nothing"
        out.append((f, want))
    return out


def _run_all(cluster, prompt_ids: list[int], cases) -> list[list[int]]:
    """Every case at once (one batch on the workers), on token ids; their output ids."""
    def one(fields: dict) -> list[int]:
        body = {"prompt": prompt_ids, "max_tokens": NUM_TOKENS, "temperature": 0,
                "return_token_ids": True, **fields}
        return _post(cluster, "/v1/completions", body)["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(one, [f for f, _ in cases]))


def test_penalties_bias_min_tokens_equal_transformers(cluster, cases, tokenizer) -> None:
    got = _run_all(cluster, tokenizer.encode(PROMPT), cases)
    for (fields, want), ids in zip(cases, got):
        assert ids == want, (fields, tokenizer.decode(ids), tokenizer.decode(want))
    assert all(n == 0 for n in worker_pages_used(cluster).values())


def test_chat_penalties_equal_colocated_and_disaggregated(
    disagg_cluster, colocated_cluster, tokenizer, hf_model, model_path
) -> None:
    from splitserve.engine.model.config import ModelConfig

    messages = [{"role": "user", "content": "Count: one two one two one two"}]
    fields = {"frequency_penalty": 1.2, "presence_penalty": 0.5, "repetition_penalty": 1.3,
              "logit_bias": {str(tokenizer.encode(" three")[0]): 4}}
    body = {"messages": messages, "max_tokens": NUM_TOKENS, "temperature": 0,
            "return_token_ids": True, **fields}
    ids = [_post(c, "/v1/chat/completions", body)["choices"][0]["token_ids"]
           for c in (disagg_cluster, colocated_cluster)]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    params = SamplingParams(temperature=0, frequency_penalty=1.2, presence_penalty=0.5,
                            repetition_penalty=1.3, logit_bias={tokenizer.encode(" three")[0]: 4})
    want = hf_greedy(hf_model, prompt, params, NUM_TOKENS,
                     ModelConfig.from_dir(model_path).eos_token_ids)
    assert ids[0] == ids[1] == want


def _check_chat_logprobs(content: list[dict], hf_lp, prompt_len: int, ids: list[int], k: int,
                         tokenizer) -> None:
    assert len(content) == len(ids)
    for i, (entry, tok) in enumerate(zip(content, ids)):
        row = hf_lp[prompt_len - 1 + i]
        assert abs(entry["logprob"] - row[tok].item()) < TOL, i
        assert entry["bytes"] == list(entry["token"].encode()) or "\ufffd" in entry["token"]
        want_vals, want_ids = row.topk(k)
        assert len(entry["top_logprobs"]) == k
        for alt, v, t in zip(entry["top_logprobs"], want_vals.tolist(), want_ids.tolist()):
            assert abs(alt["logprob"] - v) < TOL
            assert alt["token"] == tokenizer.decode([t])


def test_chat_top_logprobs_equal_transformers(cluster, tokenizer, hf_model) -> None:
    """Greedy, then sampled under a penalty: the reported numbers are HF's raw log-softmax
    (before the penalty), for the first token (prefill worker) and the later ones (decode)."""
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 7, "frequency_penalty": 1.0,
                                       "logit_bias": {"28": 5}}):
        body = {"messages": messages, "max_tokens": NUM_TOKENS, "logprobs": True,
                "top_logprobs": 5, "return_token_ids": True, **extra}
        choice = _post(cluster, "/v1/chat/completions", body)["choices"][0]
        ids = choice["token_ids"]
        hf_lp = hf_logprobs(hf_model, prompt + ids)
        _check_chat_logprobs(choice["logprobs"]["content"], hf_lp, len(prompt), ids, 5, tokenizer)


def test_streamed_chat_logprobs_equal_non_streamed(disagg_cluster) -> None:
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": NUM_TOKENS,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    full = _post(disagg_cluster, "/v1/chat/completions", body)["choices"][0]["logprobs"]
    streamed = []
    with httpx.stream("POST", disagg_cluster.config.url + "/v1/chat/completions",
                      json={"model": "default", **body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice["logprobs"] is not None:
                    streamed.extend(choice["logprobs"]["content"])
    # Same tokens and alternatives; numbers within TOL (the second request's prompt came from
    # the prefix cache, whose chunking changes float32 summation order).
    assert len(streamed) == len(full["content"])
    for a, b in zip(streamed, full["content"]):
        assert (a["token"], a["bytes"]) == (b["token"], b["bytes"])
        assert abs(a["logprob"] - b["logprob"]) < TOL
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]


def test_completion_echo_top_logprobs_equal_transformers(cluster, tokenizer, hf_model) -> None:
    text = "The capital of France is"
    prompt = tokenizer.encode(text)
    body = {"prompt": text, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 3,
            "return_token_ids": True}
    choice = _post(cluster, "/v1/completions", body)["choices"][0]
    ids = prompt + choice["token_ids"]
    hf_lp = hf_logprobs(hf_model, ids)
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(ids)
    for i in range(1, len(ids)):
        row = hf_lp[i - 1]
        assert abs(lp["token_logprobs"][i] - row[ids[i]].item()) < TOL, i
        want_vals, want_ids = row.topk(3)
        want = {tokenizer.decode([t]): v for t, v in zip(want_ids.tolist(), want_vals.tolist())}
        want.setdefault(tokenizer.decode([ids[i]]), row[ids[i]].item())
        got = lp["top_logprobs"][i]
        assert got.keys() == want.keys(), i
        assert all(abs(got[key] - want[key]) < TOL for key in want)


def test_several_prompts_in_one_request(cluster, tokenizer) -> None:
    prompts = ["The sky is", "Water is wet and", "2 + 2 ="]
    body = {"max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1,
            "return_token_ids": True}
    one_each = [_post(cluster, "/v1/completions", {**body, "prompt": p})["choices"][0]
                for p in prompts]
    batch = _post(cluster, "/v1/completions", {**body, "prompt": prompts})
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    for got, want in zip(batch["choices"], one_each):
        assert got["text"] == want["text"] and got["token_ids"] == want["token_ids"]
        assert all(abs(a - b) < TOL for a, b in zip(got["logprobs"]["token_logprobs"][1:],
                                                    want["logprobs"]["token_logprobs"][1:]))
    assert batch["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in prompts)
    assert batch["usage"]["completion_tokens"] == 3


def test_lm_eval_loglikelihood(disagg_cluster, tokenizer, hf_model, model_path) -> None:
    """lm-evaluation-harness's ``local-completions`` model, unmodified, batching 3 requests per
    call (``echo`` + ``logprobs: 1`` + ``max_tokens: 1`` over token ids)."""
    pytest.importorskip("tenacity")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=disagg_cluster.config.url + "/v1/completions",
                             model="default", tokenizer_backend="huggingface",
                             tokenizer=str(model_path), batch_size=3)
    docs = [("The capital of France is", " Paris"), ("The capital of France is", " banana"),
            ("Two plus two equals", " four.")]
    got = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=d, idx=i)
                            for i, d in enumerate(docs)])
    for (ctx, cont), (logprob, is_greedy) in zip(docs, got):
        # The reference: lm-eval's split of the tokens (context, then the rest), HF's scores.
        whole, ctx_ids = tokenizer.encode(ctx + cont), tokenizer.encode(ctx)
        hf_lp = hf_logprobs(hf_model, whole)
        cont_lp = [hf_lp[i - 1] for i in range(len(ctx_ids), len(whole))]
        want = sum(row[whole[i]].item() for row, i in zip(cont_lp, range(len(ctx_ids),
                                                                           len(whole))))
        want_greedy = all(int(row.argmax()) == whole[i]
                          for row, i in zip(cont_lp, range(len(ctx_ids), len(whole))))
        assert abs(logprob - want) < TOL * len(cont_lp), (ctx, cont)
        assert is_greedy == want_greedy, (ctx, cont)
    assert [g for _, g in got] != [True] * 3 and [g for _, g in got] != [False] * 3
