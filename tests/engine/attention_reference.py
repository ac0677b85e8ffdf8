"""The attention the backends are checked against: dense, one query token, float32."""

from __future__ import annotations

import torch


def reference(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, window: int | None,
              scale: float) -> torch.Tensor:
    """Dense float32 attention of one token: ``q [Hq, D]`` over ``ks/vs [S, Hkv, D]`` (grouped
    query heads share a KV head; ``window``: only the last ``window`` keys). Returns ``[Hq, D]``."""
    hq, hkv = q.shape[0], ks.shape[1]
    k = ks.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, S, D]
    v = vs.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    s = (q.float()[:, None, :] @ k.transpose(1, 2)).squeeze(1) * scale  # [Hq, S]
    if window is not None:
        s[:, : max(0, ks.shape[0] - window)] = float("-inf")
    return (torch.softmax(s, -1)[:, None, :] @ v).squeeze(1)
