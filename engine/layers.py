"""Building blocks shared by the model files: linear, RMSNorm, gated SiLU MLP.

Parameters are created uninitialized (``torch.empty``): the loader fills every one of them, and
random init of a large model would cost seconds for nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ W.T + b``; ``W [out, in]``. Fused projections are one Linear with the HF
    weights stacked along ``out`` (the loader writes each HF shard into its row slice)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features, dtype=dtype)
        self.bias = _empty(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` -> ``[T, out]``."""
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm as transformers' Llama computes it: statistics in float32, the normalized value
    cast back to the input dtype before the weight multiply (so bf16 rounds where HF rounds)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> same shape and dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``gate_up_proj``."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias, dtype)
        self.down_proj = Linear(intermediate, hidden, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Embedding(nn.Module):
    """Token embedding table ``weight [vocab, hidden]``."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty(vocab_size, hidden, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T]`` int64 -> ``[T, hidden]``."""
        return F.embedding(ids, self.weight)
