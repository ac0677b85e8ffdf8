"""Weight-only quantization at load time (``EngineConfig.quantization``, ``--quantization``).

``int8``: symmetric per-output-channel int8, the scheme of torch's ``_weight_int8pack_mm`` and
of LLM.int8()'s weight half: for each output row ``n`` of ``W [N, K]``,
``s[n] = max_k |W[n, k]| / 127`` and ``Q[n, k] = round(W[n, k] / s[n])`` in ``-127..127``
(round half to even, as ``torch.round``). The served model is the de-quantized one,
``W' = s[:, None] * Q``: every product computes ``x @ W'.T``, either exactly in integers
(``csrc/gemm_w8.c`` for decode steps, x quantized per row to int16 there) or with ``W'``
materialized in the serving dtype (oneDNN for prompt steps and above the kernel plan's
crossover; float32 serving: ``F.linear`` on ``W'``, so ``transformers`` loaded with ``W'`` is an
exact reference). Which weights: every decoder ``Linear`` and the LM head; not the token
embedding (a lookup reads one row per token, so its bytes do not matter), so a tied LM head gets
its own de-quantized copy.
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> ``(Q [N, K] int8 in -127..127, s [N] float32)``,
    per output channel (see the module docstring); an all-zero row gets ``s = 1``."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``s[:, None] * Q`` in float32 ``[N, K]``: the weight the int8 model serves."""
    return q.float() * scales[:, None]


def pack_int8_pairs(q: torch.Tensor) -> torch.Tensor:
    """``Q [N, K]`` int8 (N a multiple of 16) -> ``[N / 16, ceil(K / 2), 16, 2]`` int8, the
    layout of ``csrc/gemm_w8.c`` (the bfloat16 pair layout, one byte per weight; an odd K gets
    a zero column).

    Raises:
        ValueError: N not a multiple of 16.
    """
    n, k = q.shape
    if n % 16:
        raise ValueError(f"int8 weight packing needs N % 16 == 0, got N = {n}")
    if k % 2:
        q = torch.cat([q, q.new_zeros(n, 1)], dim=1)
    return q.reshape(n // 16, 16, (k + 1) // 2, 2).transpose(1, 2).contiguous()


class Int8Weight:
    """One projection's int8 weight: ``packed`` (:func:`pack_int8_pairs`) and ``scales [N]``
    float32, for :meth:`CpuKernels.linear_w8`; ``nbytes``: their size in bytes."""

    __slots__ = ("packed", "scales")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.packed = pack_int8_pairs(q)
        self.scales = scales.contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 4 * self.scales.numel()



def quantize_weight_int8(weight: torch.Tensor) -> Int8Weight | None:
    """Quantize ``weight [N, K]`` in place: it becomes ``W'`` (:func:`dequantize_int8`) in its
    own dtype, for oneDNN and the torch path; returns its :class:`Int8Weight` for the C decode
    products, or None where N is not a multiple of 16 (the kernel's blocks)."""
    q, scales = quantize_int8(weight)
    weight.copy_(dequantize_int8(q, scales).to(weight.dtype))
    return Int8Weight(q, scales) if weight.shape[0] % 16 == 0 else None
