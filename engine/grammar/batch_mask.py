"""One bitmask for a whole batch: filled by each constrained row's matcher, others left open."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.grammar.bitmask import allocate_bitmask
from splitserve.engine.request import Req


def fill_grammar_bitmask(reqs: Sequence[Req], vocab_size: int) -> tuple[torch.Tensor | None, list[int]]:
    """Fill the next-token bitmask of every request in ``reqs`` that has a grammar.

    Args:
        reqs: the requests sampled this step, in logits-row order.
        vocab_size: the model's logits width.

    Returns:
        ``(bitmask, rows)``: ``rows`` are the constrained rows (the only ones to mask, so that
        unconstrained requests in the batch keep their logits bit for bit); ``bitmask`` is None
        when no row is constrained.
    """
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return None, []
    if vocab_size <= 0:
        raise ValueError("a constrained request needs the runner's vocab_size")
    bitmask = allocate_bitmask(len(reqs), vocab_size)
    for i in rows:
        reqs[i].grammar.fill_bitmask(bitmask, i)  # type: ignore[union-attr]
    return bitmask, rows
