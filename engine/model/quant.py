"""Weight-only quantization at load time (``EngineConfig.quantization``, ``--quantization``).

``int8`` on CPU: symmetric int8 with one float32 scale per output row and **block of 32 input
channels**, llama.cpp's Q8_0 grid: for row ``n`` of ``W [N, K]`` and block ``g``,
``s[n, g] = max_{k in g} |W[n, k]| / 127`` and ``Q[n, k] = round(W[n, k] / s[n, g])`` in
``-127..127`` (round half to even, as ``torch.round``; a last, shorter block where 32 does not
divide K). 9 bits per weight: Q8_0's float16 scales cost +0.14% perplexity on SmolLM2 against
+0.02% with float32 (``bench/quality.py``). One scale per row (torch's ``_weight_int8pack_mm``, LLM.int8()'s weight half) cost
+0.56% perplexity on SmolLM2 against Q8_0's +0.41%; per block it follows each block's range.
The served model is the de-quantized one, ``W' = s * Q`` (each scale over its block): every
product computes ``x @ W'.T``, either exactly in integers per block (``csrc/gemm_w8.c`` for
decode steps, x quantized per row and block of 32 to int8 there, as llama.cpp's Q8_0
activations) or with ``W'`` materialized in the serving dtype (oneDNN for prompt steps and above
the kernel plan's crossover; float32 serving: ``F.linear`` on ``W'``, so ``transformers`` loaded
with ``W'`` is an exact reference). Which weights: every decoder ``Linear`` and the LM head; not
the token embedding (a lookup reads one row per token, so its bytes do not matter), so a tied LM
head gets its own de-quantized copy.

On CUDA (``engine.model.quant_gpu``) int8 keeps one scale per output row
(:func:`quantize_int8`), the layout of its Triton kernel.
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> ``(Q [N, K] int8 in -127..127, s [N] float32)``,
    one scale per output channel (the CUDA int8 weights' scheme; the CPU's is
    :func:`quantize_int8_groups`); an all-zero row gets ``s = 1``."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


GROUP = 32  # input channels per scale of the CPU int8 weights (Q8_0's block)


def quantize_int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> ``(Q [N, K] int8 in -127..127, s [N, G] float32)``
    with ``G = ceil(K / 32)``, one scale per row and block of 32 (see the module docstring); an
    all-zero block gets ``s = 1``."""
    w = weight.detach().float()
    n, k = w.shape
    g = -(-k // GROUP)
    padded = torch.zeros(n, g * GROUP)
    padded[:, :k] = w
    amax = padded.abs().reshape(n, g, GROUP).amax(dim=2)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / _expand_blocks(scales, k)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def _expand_blocks(scales: torch.Tensor, k: int) -> torch.Tensor:
    """``[N, G]`` block scales -> ``[N, K]``: each repeated over its block of 32."""
    return scales.repeat_interleave(GROUP, dim=1)[:, :k]


def dequantize_int8_groups(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``s * Q`` in float32 ``[N, K]``, each scale of ``s [N, G]`` over its block of 32: the
    weight the CPU int8 model serves."""
    return q.float() * _expand_blocks(scales, q.shape[1])


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
    """One projection's int8 weight for :meth:`CpuKernels.linear_w8`: ``packed``
    (:func:`pack_int8_quads`) and ``scales`` float32 ``[N / 16, G, 16]`` (per 16-column block,
    per block of 32 input channels, the 16 columns' scales: what ``gemm_w8.c`` loads as one
    vector), from ``Q [N, K]`` and ``s [N, G]`` (:func:`quantize_int8_groups`); ``nbytes``:
    their size in bytes."""

    __slots__ = ("packed", "scales")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        n, g = scales.shape
        self.packed = pack_int8_quads(q)
        self.scales = scales.float().reshape(n // 16, 16, g).transpose(1, 2).contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.element_size() * self.scales.numel()



def quantize_weight_int8(weight: torch.Tensor) -> Int8Weight | None:
    """Quantize ``weight [N, K]`` in place, per block of 32 (:func:`quantize_int8_groups`): it
    becomes ``W'`` (:func:`dequantize_int8_groups`) in its own dtype, for oneDNN and the torch
    path; returns its :class:`Int8Weight` for the C decode products, or None where N is not a
    multiple of 16 (the kernel's blocks)."""
    q, scales = quantize_int8_groups(weight)
    weight.copy_(dequantize_int8_groups(q, scales).to(weight.dtype))
    return Int8Weight(q, scales) if weight.shape[0] % 16 == 0 else None
