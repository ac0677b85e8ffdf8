"""Logits processing before the grammar mask and the sampler: ``logit_bias``, ``min_tokens``,
``repetition_penalty``, ``frequency_penalty`` and ``presence_penalty``, for a whole batch at once.

One vectorised pass per step over the rows that ask for any of them: the rows' logits are
gathered once, each adjustment is a tensor op over all of them (token counts built with one
``scatter_add_`` from the rows' padded token ids, biases and masks written with one
``index_put_``), and the rows are scattered back. Nothing loops over the vocabulary in Python;
the per-row Python work is building the rows' id lists. A row with a neutral value for an
adjustment (penalty 0, repetition 1) is left bit-for-bit unchanged by it.

Order and formulas follow vLLM v1's sampler (``vllm/v1/sample/sampler.py``: logits processors
such as ``logit_bias`` and ``min_tokens`` first, then ``apply_penalties``):

1. ``logit_bias``: ``logits[t] += bias[t]`` (OpenAI: -100..100; -100 bans a token in practice).
2. ``min_tokens``: while fewer than ``min_tokens`` tokens were generated, EOS (unless
   ``ignore_eos``) and every ``stop_token_ids`` entry get ``-inf``.
3. ``repetition_penalty`` ``r`` over prompt + output tokens (CTRL, Keskar et al. 2019, as vLLM
   and transformers apply it): a seen token's logit ``x`` becomes ``x / r`` if ``x > 0`` else
   ``x * r``.
4. ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` over the output tokens so far
   (OpenAI's definition): ``logits[t] -= f * count[t] + p * (count[t] > 0)``.

The state each step needs is the request's own token lists (``Req.input_ids``,
``Req.output_ids``): nothing is cached between steps, so a retracted, forked or speculative
sequence needs nothing more than its token lists to be penalised right.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from splitserve.engine.sched.request import Req


def needs_processing(req: Req) -> bool:
    """Whether ``req``'s next token needs :func:`process_logits` (a penalty, a bias, or
    ``min_tokens`` not reached yet)."""
    s = req.sampling
    return s.has_penalties or len(req.output_ids) < s.min_tokens


def process_logits(
    logits: torch.Tensor,
    rows: Sequence[int],
    reqs: Sequence[Req],
    eos_token_ids: frozenset[int] | Sequence[int],
) -> None:
    """Apply each request's bias, ``min_tokens`` mask and penalties to its row, in place.

    Args:
        logits: float ``[B, V]`` logits of the sampled rows (float32 on CPU; any float dtype).
        rows: indices into ``logits``, one per ``reqs`` entry, distinct.
        reqs: the requests whose next token each row samples; read only (``sampling``,
            ``input_ids``, ``output_ids``).
        eos_token_ids: the model's EOS ids, masked by ``min_tokens`` unless ``ignore_eos``.

    Raises:
        ValueError: ``rows`` and ``reqs`` differ in length, or a ``logit_bias`` or stop id is
            not a column of ``logits`` (the server refuses those as a 400 first).
    """
    if len(rows) != len(reqs):
        raise ValueError(f"{len(rows)} rows for {len(reqs)} requests")
    if not rows:
        return
    device, num_vocab = logits.device, logits.shape[-1]
    index = torch.tensor(list(rows), dtype=torch.long, device=device)
    sub = logits.index_select(0, index)
    params = [r.sampling for r in reqs]

    _add_bias_and_min_tokens(sub, reqs, eos_token_ids)

    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        seen = _token_mask(
            [r.input_ids + r.output_ids if p != 1.0 else [] for r, p in zip(reqs, rep)],
            num_vocab, device,
        )
        penalty = torch.tensor(rep, dtype=sub.dtype, device=device)[:, None]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(seen, penalised, sub)

    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    if any(freq) or any(pres):
        counts = _token_counts(
            [r.output_ids if f or q else [] for r, f, q in zip(reqs, freq, pres)],
            num_vocab, device,
        ).to(sub.dtype)
        f_t = torch.tensor(freq, dtype=sub.dtype, device=device)[:, None]
        p_t = torch.tensor(pres, dtype=sub.dtype, device=device)[:, None]
        sub = sub - (f_t * counts + p_t * (counts > 0).to(sub.dtype))

    logits.index_copy_(0, index, sub)


def _add_bias_and_min_tokens(
    sub: torch.Tensor, reqs: Sequence[Req], eos_token_ids: frozenset[int] | Sequence[int]
) -> None:
    """Steps 1 and 2, in place on ``sub`` (one row per request): one ``index_put_`` each."""
    num_vocab = sub.shape[-1]
    bias_rows, bias_cols, bias_vals = [], [], []
    ban_rows, ban_cols = [], []
    for i, req in enumerate(reqs):
        s = req.sampling
        for tok, bias in s.logit_bias.items():
            bias_rows.append(i)
            bias_cols.append(tok)
            bias_vals.append(bias)
        if len(req.output_ids) < s.min_tokens:
            stops = set(s.stop_token_ids) if s.ignore_eos else {*s.stop_token_ids, *eos_token_ids}
            ban_rows.extend([i] * len(stops))
            ban_cols.extend(stops)
    bad = [t for t in (*bias_cols, *ban_cols) if not 0 <= t < num_vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the logits' {num_vocab} columns")
    device = sub.device
    if bias_rows:
        sub.index_put_(
            (torch.tensor(bias_rows, device=device), torch.tensor(bias_cols, device=device)),
            torch.tensor(bias_vals, dtype=sub.dtype, device=device),
            accumulate=True,
        )
    if ban_rows:
        sub.index_put_(
            (torch.tensor(ban_rows, device=device), torch.tensor(ban_cols, device=device)),
            torch.tensor(float("-inf"), dtype=sub.dtype, device=device),
        )


def _padded_ids(seqs: Sequence[list[int]], num_vocab: int, device: torch.device) -> torch.Tensor:
    """``[R, L]`` int64 ids, each row padded with ``num_vocab`` (an extra, discarded column)."""
    rows = [torch.tensor(s if s else [num_vocab], dtype=torch.long) for s in seqs]
    return pad_sequence(rows, batch_first=True, padding_value=num_vocab).to(device)


def _token_counts(seqs: Sequence[list[int]], num_vocab: int, device: torch.device) -> torch.Tensor:
    """``[R, V]`` int32: how often each token occurs in each row's sequence."""
    ids = _padded_ids(seqs, num_vocab, device)
    counts = torch.zeros(len(seqs), num_vocab + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :num_vocab]


def _token_mask(seqs: Sequence[list[int]], num_vocab: int, device: torch.device) -> torch.Tensor:
    """``[R, V]`` bool: whether each token occurs in each row's sequence."""
    ids = _padded_ids(seqs, num_vocab, device)
    seen = torch.zeros(len(seqs), num_vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, ids, True)
    return seen[:, :num_vocab]
