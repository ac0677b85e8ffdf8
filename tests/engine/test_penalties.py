"""Logits processing (``engine.runner.penalties``): the vectorised pass equals the formulas row by
row at batch > 1 with different params per row, and greedy decoding under each penalty and
``logit_bias`` through the real scheduler and runner equals ``transformers``' float32 logits with
the formulas applied step by step."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.kv_pool import KVPool
from splitserve.engine.runner.penalties import needs_processing, process_logits
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import SamplingParams
from tests.engine_core import make_core
from tests.sampling_reference import hf_greedy, reference_process

V = 64
EOS = [2]


def _req(prompt: list[int], output: list[int], **params) -> Req:
    req = Req("r", list(prompt), SamplingParams(**params))
    req.output_ids = list(output)
    return req


ROWS = [  # (prompt, output, params): one batch, each row its own mix
    ([1, 5, 5, 9], [5, 7, 7, 7], {"frequency_penalty": 0.7}),
    ([3, 4], [4, 4, 8], {"presence_penalty": -1.2}),
    ([10, 11, 12], [12, 30], {"repetition_penalty": 1.8}),
    ([10, 11, 12], [12, 30], {"repetition_penalty": 0.6}),
    ([6], [], {"logit_bias": {3: 5.0, 50: -100.0, 0: 0.25}}),
    ([6, 7], [8], {"min_tokens": 3, "stop_token_ids": [9, 11]}),
    ([6, 7], [8], {"min_tokens": 3, "stop_token_ids": [9], "ignore_eos": True}),
    ([6, 7], [8, 8, 8], {"min_tokens": 3, "stop_token_ids": [9]}),  # reached: nothing masked
    ([1, 2, 3], [3, 3, 1], {"frequency_penalty": 0.5, "presence_penalty": 0.3,
                                "repetition_penalty": 1.3, "logit_bias": {3: 2.0}, "min_tokens": 5,
                                "stop_token_ids": [7]}),
    ([6, 7], [8, 8], {"min_tokens": 3, "stop_token_ids": [9]}),  # one short: still masked
    ([1, 2], [2], {}),  # neutral
]


def test_vectorised_pass_equals_the_formulas_row_by_row() -> None:
    logits = torch.randn(len(ROWS) + 2, V, generator=torch.Generator().manual_seed(0)) * 3
    reqs = [_req(p, o, **kw) for p, o, kw in ROWS]
    rows = [i + 1 for i in range(len(ROWS))]  # not the first/last rows: those must stay put
    got = logits.clone()
    process_logits(got, rows, reqs, frozenset(EOS))
    assert torch.equal(got[0], logits[0]) and torch.equal(got[-1], logits[-1])
    for row, req in zip(rows, reqs):
        want = reference_process(logits[row], req.input_ids, req.output_ids, req.sampling, EOS)
        assert torch.allclose(got[row].double(), want, atol=1e-5), req.sampling
    # A neutral row is bit-for-bit unchanged by the pass.
    assert torch.equal(got[rows[-1]], logits[rows[-1]])
    # min_tokens: EOS and stop ids banned while short, EOS kept with ignore_eos, all free after.
    assert got[6, 2] == got[6, 9] == got[6, 11] == float("-inf")
    assert got[7, 9] == float("-inf") and got[7, 2] == logits[7, 2]
    assert torch.equal(got[8], logits[8])


def test_needs_processing() -> None:
    assert not needs_processing(_req([1], [], temperature=0.5))
    assert needs_processing(_req([1], [], logit_bias={1: 1.0}))
    assert needs_processing(_req([1], [4], min_tokens=2))
    assert not needs_processing(_req([1], [4, 4], min_tokens=2))


def test_out_of_range_token_id_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        process_logits(torch.zeros(1, V), [0], [_req([1], [], logit_bias={V: 1.0})], EOS)


PROMPT = "one two one two one two one two one two one two"
CASES = [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"repetition_penalty": 2.0},
    {"frequency_penalty": -0.8, "presence_penalty": 0.9},
]


@pytest.mark.slow
def test_greedy_with_penalties_equals_transformers(model, tokenizer, hf_model) -> None:
    """All cases and a plain row in one batch (batch > 1, params differ per row), 8 tokens each;
    each case must also change the plain greedy output, or it would prove nothing."""
    torch.set_num_threads(1)
    net, cfg = model
    prompt = tokenizer.encode(PROMPT)
    plain_ids = tokenizer.encode(" two")
    cases = [*CASES, {"logit_bias": {plain_ids[0]: -100.0, tokenizer.encode(" three")[0]: 8.0}}]
    params = [SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, **c)
              for c in cases] + [SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)]
    core = make_core(net, KVPool(cfg.kv_layout(16, "float32"), 64), cfg.eos_token_ids)
    reqs = [Req(f"r{i}", prompt, p) for i, p in enumerate(params)]
    for r in reqs:
        core.scheduler.add(r)
    while core.scheduler.has_work:
        core.step()
    plain = reqs[-1].output_ids
    assert plain == hf_greedy(hf_model, prompt, params[-1], 8, cfg.eos_token_ids)
    for req in reqs[:-1]:
        want = hf_greedy(hf_model, prompt, req.sampling, 8, cfg.eos_token_ids)
        assert req.output_ids == want, (req.sampling, tokenizer.decode(req.output_ids))
        assert req.output_ids != plain, f"{req.sampling} does not change the output"


@pytest.mark.slow
def test_min_tokens_and_stop_token_ids(model, tokenizer, hf_model) -> None:
    """A stop id that greedy decoding would emit at once: without min_tokens the output is that
    one token (finish stop); with min_tokens 4 it comes no earlier than the 5th token."""
    torch.set_num_threads(1)
    net, cfg = model
    prompt = tokenizer.encode(PROMPT)
    first = hf_greedy(hf_model, prompt, SamplingParams(temperature=0), 1, cfg.eos_token_ids)[0]
    core = make_core(net, KVPool(cfg.kv_layout(16, "float32"), 64), cfg.eos_token_ids)
    stop = Req("stop", prompt, SamplingParams(max_new_tokens=8, temperature=0,
                                              stop_token_ids=[first]))
    held = Req("held", prompt, SamplingParams(max_new_tokens=8, temperature=0,
                                              stop_token_ids=[first], min_tokens=4))
    for r in (stop, held):
        core.scheduler.add(r)
    while core.scheduler.has_work:
        core.step()
    assert stop.output_ids == [first] and stop.finish_reason == "stop"
    assert first not in held.output_ids[:4]
    assert held.output_ids == hf_greedy(hf_model, prompt, held.sampling, 8, cfg.eos_token_ids)


@pytest.mark.slow
def test_logprobs_are_raw_under_processing(model, tokenizer, hf_model) -> None:
    """Sampled under a bias, a penalty and min_tokens, with alternatives asked for: every
    reported logprob and alternative is HF's log-softmax before any of them (first token and
    later ones), and the chosen token's logprob is its raw one."""
    from tests.sampling_reference import hf_logprobs

    torch.set_num_threads(1)
    net, cfg = model
    prompt = tokenizer.encode(PROMPT)
    params = SamplingParams(max_new_tokens=5, temperature=0.9, seed=3, top_logprobs=4,
                            frequency_penalty=1.0, repetition_penalty=1.4, min_tokens=2,
                            logit_bias={tokenizer.encode(" three")[0]: 3.0})
    core = make_core(net, KVPool(cfg.kv_layout(16, "float32"), 64), cfg.eos_token_ids)
    req = Req("r", prompt, params)
    core.scheduler.add(req)
    while core.scheduler.has_work:
        core.step()
    hf_lp = hf_logprobs(hf_model, prompt + req.output_ids)
    assert len(req.output_top_ids) == len(req.output_ids) == 5
    for i, tok in enumerate(req.output_ids):
        row = hf_lp[len(prompt) - 1 + i]
        assert abs(req.output_logprobs[i] - row[tok].item()) < 1e-3, i
        want_vals, want_ids = row.topk(4)
        assert req.output_top_ids[i] == want_ids.tolist(), i
        assert max(abs(a - b) for a, b in zip(req.output_top_logprobs[i], want_vals.tolist())) < 1e-3
