"""Logprobs as OpenAI reports them: of the raw distribution (``log_softmax`` of the model's
logits, before penalties, biases, grammar masks, temperature or filters), for the chosen token
and for the ``top_logprobs`` most likely alternatives. vLLM's default (``raw_logprobs``) and
OpenAI's own answers follow the same convention."""

from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's upper bound for ``top_logprobs``


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` float32 log-softmax of ``[N, V]`` logits (a new tensor: later in-place
    processing of ``logits`` does not change it)."""
    return torch.log_softmax(logits.float(), dim=-1)


def top_alternatives(
    logprobs: torch.Tensor, counts: Sequence[int]
) -> tuple[list[list[int]], list[list[float]]]:
    """The ``counts[i]`` most likely tokens of each row, most likely first.

    Args:
        logprobs: ``[N, V]`` float log-probabilities (:func:`raw_logprobs`).
        counts: ``N`` counts in ``0..MAX_TOP_LOGPROBS``; a row with 0 gets empty lists.

    Returns:
        ``(ids, logprobs)``: ``N`` lists each, ``ids[i][j]`` an int token id.

    Raises:
        ValueError: ``counts`` does not have one entry per row.
    """
    if len(counts) != logprobs.shape[0]:
        raise ValueError(f"{len(counts)} counts for {logprobs.shape[0]} rows")
    k = min(max(counts, default=0), logprobs.shape[-1])
    if k <= 0:
        return [[] for _ in counts], [[] for _ in counts]
    values, ids = logprobs.topk(k, dim=-1)
    all_ids, all_values = ids.tolist(), values.tolist()
    return (
        [row[:n] for row, n in zip(all_ids, counts)],
        [row[:n] for row, n in zip(all_values, counts)],
    )
