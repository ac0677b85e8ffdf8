"""Building blocks shared by the model files: linear, RMSNorm, gated SiLU MLP.

Parameters are created uninitialized (``torch.empty``): the loader fills every one of them, and
random init of a large model would cost seconds for nothing.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.cpu_kernels import CpuKernels, load_cpu_kernels

PACK_ENV = "SPLITSERVE_PACK_WEIGHTS"  # "0" keeps plain F.linear on CPU bfloat16


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_weight` applies: a bfloat16 weight on a CPU with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and os.environ.get(PACK_ENV, "1") != "0"
    )


def pack_weight(weight: torch.Tensor, batch_hint: int = 32) -> torch.Tensor:
    """``weight [out, in]`` reordered into oneDNN's blocked layout, once, so each product skips
    the reorder: ~20% less time per bfloat16 product at 1-512 rows, bit-identical results."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with a weight from :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_decode(weight: torch.Tensor) -> tuple[CpuKernels | None, torch.Tensor | None]:
    """The C kernels and ``weight`` packed for their decode-step products (CPU bfloat16 only,
    same switch as :func:`can_pack` plus ``SPLITSERVE_CPU_KERNELS``), or ``(None, None)``."""
    if not can_pack(weight) or not CpuKernels.can_pack_decode(weight):
        return None, None
    kernels = load_cpu_kernels()
    if kernels is None:
        return None, None
    return kernels, CpuKernels.pack_decode(weight.data)


class Linear(nn.Module):
    """``y = x @ W.T + b``; ``W [out, in]``. Fused projections are one Linear with the HF
    weights stacked along ``out`` (the loader writes each HF shard into its row slice)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features, dtype=dtype)
        self.bias = _empty(out_features, dtype=dtype) if bias else None
        self.packed: torch.Tensor | None = None  # set by pack(); not a parameter
        # Set by pack() too: the C kernels for decode steps and the weight in their layout.
        self.kernels: CpuKernels | None = None
        self.decode_packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Pre-pack the weight for oneDNN if :func:`can_pack` (call after loading; the plain
        weight stays, for anything that reads parameters), and for the C decode products (steps
        of at most ``kernels.decode_max_rows`` rows) when they build."""
        if can_pack(self.weight):
            self.packed = pack_weight(self.weight.data)
        self.kernels, self.decode_packed = pack_decode(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` -> ``[T, out]``."""
        if self.decode_packed is not None and x.dim() == 2:
            assert self.kernels is not None
            if x.shape[0] <= self.kernels.decode_max_rows:
                return self.kernels.linear_decode(x.contiguous(), self.decode_packed, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm as transformers' Llama computes it: statistics in float32, the normalized value
    cast back to the input dtype before the weight multiply (so bf16 rounds where HF rounds)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty(hidden_size, dtype=dtype)
        self.eps = eps
        self.kernels: CpuKernels | None = None  # the C kernel for bfloat16 on CPU, when set

    def _use_kernel(self, x: torch.Tensor) -> bool:
        return self.kernels is not None and x.dtype == torch.bfloat16 and x.dim() == 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> same shape and dtype."""
        if self._use_kernel(x) and x.stride(1) == 1:
            assert self.kernels is not None
            return self.kernels.rms_norm(x, self.weight, self.eps)[0]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)`` for ``x``, ``residual [T, hidden]``: one C
        call in bfloat16 on CPU (same rounding), else two steps."""
        if self._use_kernel(x) and x.stride(1) == 1 and residual.is_contiguous():
            assert self.kernels is not None
            return self.kernels.rms_norm(x, self.weight, self.eps, residual)
        res = residual + x
        return self(res), res


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``gate_up_proj``."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias, dtype)
        self.down_proj = Linear(intermediate, hidden, bias, dtype)
        self.kernels: CpuKernels | None = None  # the C silu-multiply for bfloat16 on CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None and gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2:
            return self.down_proj(self.kernels.silu_mul(gate_up.contiguous()))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Embedding(nn.Module):
    """Token embedding table ``weight [vocab, hidden]``."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty(vocab_size, hidden, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T]`` int64 -> ``[T, hidden]``."""
        return F.embedding(ids, self.weight)
