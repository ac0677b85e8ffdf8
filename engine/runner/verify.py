"""Verify speculative drafts: from the logits at every drafted position, keep the longest prefix
of the draft the target model agrees with and add the token after it.

Greedy rows keep draft token ``d_t`` while it is the argmax at its position, so the output is
exactly plain greedy decoding. Sampled rows use speculative rejection sampling (Leviathan et
al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023) with a
draft distribution that is a point mass on ``d_t`` (n-gram drafts are deterministic): keep
``d_t`` with probability ``p_t(d_t)``; on the first rejection draw from ``p_t`` with ``d_t``
removed and renormalised, i.e. ``max(0, p - q)`` normalised; if every draft is kept, draw the
bonus token from ``p_K``. Each output token is then distributed exactly as under plain sampling
from ``p`` (``p`` being the filtered distribution ``sampling.filtered_probs`` gives).
"""

from __future__ import annotations

import torch

from splitserve.engine.runner.sampling import filtered_probs, make_generator
from splitserve.engine.sched.batch import Verified
from splitserve.ipc.messages import SamplingParams


def position_generator(seed: int | None, position: int) -> torch.Generator | None:
    """The generator of output position ``position`` of a request seeded with ``seed`` (None:
    unseeded), the same stream plain decoding uses for that position
    (``model_runner._step_generator``)."""
    if seed is None:
        return None
    return make_generator((seed * 1_000_003 + position) % (2**63))


def verify_drafts(
    logits: torch.Tensor,
    drafts: list[list[int]],
    params: list[SamplingParams],
    first_positions: list[int],
    logprobs: torch.Tensor | None = None,
) -> list[Verified]:
    """Verify each row's draft against its logits.

    Args:
        logits: ``[sum(len(d) + 1 for d in drafts), V]`` float logits, row by row: for a row
            with draft ``d``, ``len(d) + 1`` consecutive logits, those at position ``t``
            predicting the token that ``d[t]`` proposes (the last predicts the bonus token).
        drafts: per row, its draft token ids (may be empty: one plain sample).
        params: per row, its sampling params.
        first_positions: per row, the output position (``len(req.output_ids)``) of its first
            new token; seeded rows draw position ``first_positions[i] + t`` from its own
            generator (:func:`position_generator`).
        logprobs: the logprobs to report per position (``[rows, V]``, e.g. the raw ones taken
            before a grammar mask); default the log-softmax of ``logits``.

    Returns:
        One :class:`Verified` per row.

    Raises:
        ValueError: ``logits`` does not have one row per drafted position.
    """
    sizes = [len(d) + 1 for d in drafts]
    if logits.dim() != 2 or logits.shape[0] != sum(sizes) or not len(params) == len(drafts):
        raise ValueError(f"logits {tuple(logits.shape)} do not match drafts of sizes {sizes}")
    logits = logits.float()
    logsm = torch.log_softmax(logits, dim=-1) if logprobs is None else logprobs
    greedy = logits.argmax(dim=-1).tolist()
    out: list[Verified] = []
    row = 0
    for draft, p, first in zip(drafts, params, first_positions, strict=True):
        n = len(draft) + 1
        if p.is_greedy:
            choice = greedy[row : row + n]
            kept = 0
            while kept < len(draft) and draft[kept] == choice[kept]:
                kept += 1
            tokens = draft[:kept] + [choice[kept]]
        else:
            tokens, kept = _rejection_sample(logits[row : row + n], draft, p, first)
        lps = logsm[row : row + len(tokens)].gather(1, torch.tensor(tokens)[:, None])
        out.append(Verified(tokens, lps[:, 0].tolist(), kept))
        row += n
    return out


def _rejection_sample(
    logits: torch.Tensor, draft: list[int], params: SamplingParams, first: int
) -> tuple[list[int], int]:
    """One sampled row: ``(tokens, kept)``; see the module docstring."""
    probs = filtered_probs(logits, [params] * logits.shape[0])
    probs = probs / probs.sum(dim=-1, keepdim=True)
    for t, d in enumerate(draft):
        gen = position_generator(params.seed, first + t)
        u = torch.rand((), generator=gen, device=probs.device) if gen else torch.rand(())
        if float(u) < float(probs[t, d]):
            continue
        residual = probs[t].clone()
        residual[d] = 0.0  # max(0, p - q) with q the point mass on d, before normalising
        return draft[:t] + [_draw(residual, gen)], t
    gen = position_generator(params.seed, first + len(draft))
    return draft + [_draw(probs[len(draft)], gen)], len(draft)


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token from unnormalised ``probs [V]`` (the exponential race, as ``sampling``)."""
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int((probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax())
