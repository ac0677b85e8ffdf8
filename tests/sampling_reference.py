"""The independent reference for logits processing and logprobs: the formulas written out token by
token in plain Python over ``transformers``' float32 logits, with no code shared with
``engine.runner.penalties`` or ``engine.runner.logprobs``."""

from __future__ import annotations

from collections import Counter

import torch

from splitserve.ipc.messages import SamplingParams


def reference_process(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    s: SamplingParams,
    eos_token_ids: list[int],
) -> torch.Tensor:
    """One row ``[V]``: logit_bias, min_tokens, repetition (prompt + output, CTRL/vLLM),
    frequency and presence (output; OpenAI), in vLLM's order. Returns a new tensor."""
    x = logits.double().clone()
    for tok, bias in s.logit_bias.items():
        x[tok] += bias
    if len(output) < s.min_tokens:
        stops = list(s.stop_token_ids) + ([] if s.ignore_eos else list(eos_token_ids))
        for tok in stops:
            x[tok] = float("-inf")
    if s.repetition_penalty != 1.0:
        for tok in set(prompt) | set(output):
            v = x[tok].item()
            x[tok] = v / s.repetition_penalty if v > 0 else v * s.repetition_penalty
    for tok, count in Counter(output).items():
        x[tok] -= s.frequency_penalty * count + s.presence_penalty
    return x


def hf_last_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """``transformers``' float32 logits ``[V]`` after the sequence ``ids``."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0, -1].float()


def hf_greedy(
    hf_model, prompt: list[int], s: SamplingParams, num_tokens: int, eos_token_ids: list[int]
) -> list[int]:
    """Greedy tokens: each step the reference processing over HF logits, then argmax; stops at
    EOS / a stop id once ``min_tokens`` allows, like the engine."""
    out: list[int] = []
    with torch.inference_mode():
        step = hf_model(torch.tensor([prompt]), use_cache=True)
        for _ in range(num_tokens):
            logits = step.logits[0, -1].float()
            tok = int(reference_process(logits, prompt, out, s, eos_token_ids).argmax())
            out.append(tok)
            stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos_token_ids))
            if tok in stops and len(out) > s.min_tokens:
                break
            step = hf_model(torch.tensor([[tok]]), past_key_values=step.past_key_values,
                            use_cache=True)
    return out


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` float32 log-softmax of HF's logits at every position of ``ids``."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
