"""Weight-only quantization at load time (``EngineConfig.quantization``, ``--quantization``).

``int8``: symmetric per-output-channel int8, the scheme of torch's ``_weight_int8pack_mm`` and
of LLM.int8()'s weight half: for each output row ``n`` of ``W [N, K]``,
``s[n] = max_k |W[n, k]| / 127`` and ``Q[n, k] = round(W[n, k] / s[n])`` in ``-127..127``
(round half to even, as ``torch.round``). The served model is the de-quantized one,
``W' = s[:, None] * Q``: every product computes ``x @ W'.T``, either exactly in integers
(``csrc/gemm_w8.c`` for decode steps, x quantized per row and group of 32 to int8 there, as
llama.cpp's Q8_0 activations) or with ``W'``
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


def pack_int8_quads(q: torch.Tensor) -> torch.Tensor:
    """``Q [N, K]`` int8 (N a multiple of 16) -> ``[N / 16, G * 8, 16, 4]`` uint8 with ``G =
    ceil(K / 32)``, the layout of ``csrc/gemm_w8.c``: ``U = Q + 128`` (vpdpbusd's unsigned
    operand), each 4 consecutive K of 16 columns one 64-byte vector, K padded to ``32 G`` with
    ``U = 128`` (a zero weight).

    Raises:
        ValueError: N not a multiple of 16.
    """
    n, k = q.shape
    if n % 16:
        raise ValueError(f"int8 weight packing needs N % 16 == 0, got N = {n}")
    kp = -(-k // 32) * 32
    u = torch.full((n, kp), 128, dtype=torch.int16)
    u[:, :k] = q.to(torch.int16) + 128
    return u.to(torch.uint8).reshape(n // 16, 16, kp // 4, 4).transpose(1, 2).contiguous()


class Int8Weight:
    """One projection's int8 weight: ``packed`` (:func:`pack_int8_quads`) and ``scales [N]``
    float32, for :meth:`CpuKernels.linear_w8`; ``nbytes``: their size in bytes."""

    __slots__ = ("packed", "scales")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.packed = pack_int8_quads(q)
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
