"""Baseline for bench/serving.py: Hugging Face ``transformers`` ``generate`` on static batches.

The prompts are cut into batches of ``batch_size`` (left padding, greedy, exactly ``output_len``
new tokens each: ``min_new_tokens`` keeps EOS from ending a row early, like ``ignore_eos``) and
generated one batch after another, in process, on ``device``. Each step's time is taken by a
stopping criterion that transformers calls once per generated token (after a device sync), so
every request gets the same metrics as a served one: TTFT (batch start to its first token), ITL
(the gaps between steps) and end-to-end latency. A static batch is what ``generate`` serves well:
no request joins or leaves until the whole batch ends.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch


class _StepClock:
    """A ``StoppingCriteria`` that records when each generation step ends; never stops."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def load_hf(model_path: str, dtype: str, device: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``model_path`` in ``dtype`` ("float32" | "bfloat16") on
    ``device``, eval mode, the tokenizer padding on the left."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    return model.to(device).eval(), tok


def generate_static(
    model: Any, tok: Any, prompts: list[list[int]], output_len: int, batch_size: int
) -> tuple[list[dict[str, Any]], float]:
    """Generate every prompt (token ids) in static batches of ``batch_size``.

    Returns:
        ``(per-request records, wall seconds)``; a record has ``start`` (s since the run's
        start), ``ttft`` and ``latency`` (s), ``itls`` (s, one per step after the first),
        ``prompt_len`` and ``output_tokens``.
    """
    from transformers import StoppingCriteriaList

    device = next(model.parameters()).device
    records: list[dict[str, Any]] = []
    t_run = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        enc = tok.pad({"input_ids": chunk}, return_tensors="pt").to(device)
        clock = _StepClock(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        new_tokens = out.shape[1] - enc["input_ids"].shape[1]
        stamps = clock.stamps or [time.perf_counter()]
        itls = [b - a for a, b in itertools.pairwise(stamps)]
        for ids in chunk:
            records.append(
                {
                    "start": t0 - t_run,
                    "ttft": stamps[0] - t0,
                    "latency": stamps[-1] - t0,
                    "itls": itls,
                    "prompt_len": len(ids),
                    "output_tokens": new_tokens,
                }
            )
    return records, time.perf_counter() - t_run
