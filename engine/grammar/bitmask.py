"""Batch token bitmasks (xgrammar's layout) and applying them to logits.

Layout: int32 ``[B, ceil(V/32)]``; token ``t`` is allowed in row ``b`` when bit ``t % 32`` of
``bitmask[b, t // 32]`` is set. Both backends write this layout, so sampling code has one path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:  # xgrammar has fused CPU/CUDA/Triton kernels; the torch fallback keeps outlines-only setups working.
    from xgrammar import apply_token_bitmask_inplace as _xgr_apply
except ImportError:  # pragma: no cover - exercised only without xgrammar installed
    _xgr_apply = None

_BIT_POSITIONS = torch.arange(32, dtype=torch.int32)


def bitmask_width(vocab_size: int) -> int:
    """Returns: the number of int32 words per row for a vocabulary of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """Allocate a CPU bitmask with every token allowed (rows of unconstrained requests stay so).

    Args:
        batch_size: rows, one per request in the batch.
        vocab_size: the model's vocabulary size (logits width).

    Returns:
        int32 tensor ``[batch_size, ceil(vocab_size/32)]`` filled with -1 (all bits set).
    """
    return torch.full((batch_size, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None
) -> None:
    """Set the logits of disallowed tokens to ``-inf``, in place.

    Args:
        logits: float ``[B, V]`` on any device.
        bitmask: int32 ``[B, ceil(V/32)]``; moved to ``logits``' device if needed.
        rows: the rows that are constrained; None means all. Other rows are left untouched, so
            unconstrained requests in the same batch are not affected.
    """
    if rows is not None and len(rows) == 0:
        return
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if _xgr_apply is not None:
        indices = None if rows is None else list(rows)
        _xgr_apply(logits, bitmask, vocab_size=logits.shape[-1], indices=indices)
        return
    apply_bitmask_torch(logits, bitmask, rows)


def apply_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None
) -> None:
    """Plain-torch ``apply_bitmask`` (reference implementation and fallback).

    Args: as for ``apply_bitmask``; ``bitmask`` must already be on ``logits``' device.
    """
    index = torch.arange(logits.shape[0], device=logits.device) if rows is None else None
    if index is None:
        index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    vocab_size = logits.shape[-1]
    words = bitmask.index_select(0, index)
    bits = (words.unsqueeze(-1) >> _BIT_POSITIONS.to(words.device)) & 1
    allowed = bits.reshape(len(index), -1)[:, :vocab_size].bool()
    sub = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, sub)
