"""Group-wise weight-only int4 (``--quantization int4``), quantized at load time.

Scheme: asymmetric, groups of :data:`GROUP` = 32 consecutive input channels, one float16 scale
``s`` and one float16 offset ``m`` per group and output row: the served weight is
``W' = s * U + m`` with ``U`` in ``0..15``. Quantizing a group of ``W [N, K]``:
``m = fp16(min)``, ``s = fp16((max - m) / 15)``, ``U = clamp(round((W - m) / s), 0, 15)``.

Why asymmetric (a zero point per group), measured on the default model (SmolLM2-135M,
``python bench/quality.py --tokens 2048 --threads 1``, bfloat16, layers and LM head quantized):
perplexity +3.4% over bfloat16 for min/max groups of 32, against +41% for symmetric groups
(levels ``-8..7``, the largest magnitude on ``-8``: GGUF Q4_0's rule, this module's first
version). A small model's weight groups are often far from centred on 0, and a symmetric grid
wastes the levels on the side a group does not reach. The offset costs one multiply-add per
group, row and 16 columns in ``csrc/gemm_w4.c``.

Why group 32: 128-wide groups do not divide the default model's hidden size (576 = 4.5 x
128); 32 divides every supported model's dimensions, and is GGUF's block size.

GGUF: a Q4_0 block (32 weights, float16 ``d``, ``w = d * (q - 8)``) is this format with
``s = d``, ``U = q``, ``m = -8 d`` (exact in float16). Q4_0 tensors are quantized with
``symmetric=True`` from their float32 values (in which Q4_0 de-quantizes exactly; the loader
keeps them, ``engine/model/loader.py``), which gives back the file's levels and scales bit for
bit (``tests/engine/test_quant_int4.py``): they serve the weights they hold. Q4_K's 6-bit
sub-scales and sub-minima of a float16 super-scale do not fit one float16 each without
rounding, so Q4_K tensors are de-quantized and quantized again.

Which weights: every decoder ``Linear``; the LM head is quantized to int8 instead
(``engine.model.quant``), as llama.cpp's Q4_K_M keeps its output tensor at 6 bits: on SmolLM2
(whose projections come from a Q4_1 file, so 4-bit groups of 32 find their grid again) the
4-bit head was all of int4's loss, +3.05% perplexity against -0.03% with an 8-bit head
(``bench/quality.py --tokens 2048``). The token embedding stays. The weight parameter becomes ``W'`` in the serving dtype (oneDNN serves
prompt steps and steps above the kernel plan's crossover with it; in float32 ``W'`` is the
model, so ``transformers`` loaded with ``W'`` is an exact reference); decode steps read the
4-bit copy.
"""

from __future__ import annotations

import torch

GROUP = 32  # input channels per scale
LEVELS = 15  # U in 0..LEVELS
FP16_MAX = 65504.0


def quantize_int4(weight: torch.Tensor, symmetric: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype, ``K % GROUP == 0``) -> ``(U [N, K] uint8 in 0..15,
    s [N, K / GROUP] float16, m [N, K / GROUP] float16)`` with ``W' = s * U + m`` (see the
    module docstring). ``symmetric``: Q4_0's grid instead (``s = fp16(w_max / -8)`` for the
    element of largest magnitude, ``m = -8 s``). A constant group gets ``s = 1``.

    Raises:
        ValueError: ``K`` not a multiple of :data:`GROUP`.
    """
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int4 weights need K % {GROUP} == 0, got K = {k}")
    g = weight.detach().float().reshape(n, k // GROUP, GROUP)
    if symmetric:
        top = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
        s = (top / -8.0).clamp(-FP16_MAX / 8, FP16_MAX / 8).half()
        s = torch.where(s == 0, torch.ones_like(s), s)
        m = (-8.0 * s.float()).half()
    else:
        m = g.amin(-1).clamp(-FP16_MAX, FP16_MAX).half()
        s = ((g.amax(-1) - m.float()) / LEVELS).clamp(max=FP16_MAX).half()
        s = torch.where(s == 0, torch.ones_like(s), s)
    u = torch.round((g - m.float()[..., None]) / s.float()[..., None]).clamp_(0, LEVELS)
    return u.to(torch.uint8).reshape(n, k), s, m


def dequantize_int4(u: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``s * U + m`` ``[N, K]`` in ``dtype`` (float32: the weight the int4 model serves;
    float64: the tests' reference, exact)."""
    n, k = u.shape
    w = (u.to(dtype).reshape(n, k // GROUP, GROUP) * scales.to(dtype)[..., None]
         + offsets.to(dtype)[..., None])
    return w.reshape(n, k)


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """``U [N, K]`` uint8 in 0..15 (``N % 16 == 0``, ``K % GROUP == 0``) -> ``[N / 16, K / 8,
    16, 4]`` uint8, the layout of ``csrc/gemm_w4.c``: per 16 output columns and 8 input
    channels 64 bytes, byte ``4 c + j`` holding ``U[c, 8 o + j]`` in its low nibble and
    ``U[c, 8 o + 4 + j]`` in its high one, so one 64-byte load splits (two ANDs) into two
    vectors of 4 weights per column for ``vpdpbusd``.

    Raises:
        ValueError: N not a multiple of 16 or K not of :data:`GROUP`.
    """
    n, k = u.shape
    if n % 16 or k % GROUP:
        raise ValueError(f"int4 packing needs N % 16 == 0 and K % {GROUP} == 0, got {n} x {k}")
    v = u.to(torch.uint8).reshape(n // 16, 16, k // 8, 2, 4)
    b = v[:, :, :, 0, :] | (v[:, :, :, 1, :] << 4)
    return b.permute(0, 2, 1, 3).contiguous()


def pack_int4_scales(scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``s, m [N, G]`` float16 -> ``[N / 16, G, 2, 16]`` float16: per group the 16 columns'
    scales, then their offsets, each one 32-byte load in ``csrc/gemm_w4.c``."""
    n, groups = scales.shape
    both = torch.stack([scales, offsets], dim=0).reshape(2, n // 16, 16, groups)
    return both.permute(1, 3, 0, 2).contiguous()


def unpack_int4(packed: torch.Tensor, scales: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_int4` and :func:`pack_int4_scales`: ``(U [N, K] uint8,
    s, m [N, K / GROUP] float16)`` (for tests and tools that read a packed weight back)."""
    nb, octets = packed.shape[:2]
    b = packed.permute(0, 2, 1, 3)  # [N/16, 16, K/8, 4]
    u = torch.stack([b & 0x0F, b >> 4], dim=3).reshape(nb * 16, octets * 8)
    sm = scales.permute(2, 0, 3, 1).reshape(2, nb * 16, scales.shape[1])
    return u, sm[0], sm[1]


def torch_int4_pack(u: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same weight for torch's ``_weight_int4pack_mm_for_cpu``: ``(packed uint8 [N, K/2],
    scale_and_zero [K / GROUP, N, 2] bfloat16)``. That op computes ``(U - 8) * scale + zero``
    and takes bfloat16 only, so its weight is ``(U - 8) * bf16(s) + bf16(m + 8 s)``: within a
    bfloat16 rounding of ``W'`` per group (its own reference in the tests)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), 1)
    st, mt = scales.float().t(), offsets.float().t()
    sz = torch.stack([st, mt + 8 * st], dim=-1).bfloat16().contiguous()
    return packed, sz


def torch_int4_weight(u: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
                      ) -> torch.Tensor:
    """The float64 weight torch's int4 kernel computes with (:func:`torch_int4_pack`)."""
    n, k = u.shape
    s = scales.float().bfloat16().double()
    z = (offsets.float() + 8 * scales.float()).bfloat16().double()
    w = (u.double().reshape(n, k // GROUP, GROUP) - 8) * s[..., None] + z[..., None]
    return w.reshape(n, k)


def torch_int4_available() -> bool:
    """Whether this torch has the CPU int4 weight-only matmul (2.4+)."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu")


def torch_int4_mm(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K]`` bfloat16 times the weight of :func:`torch_int4_pack` (+ ``bias``) ->
    ``[M, N]`` bfloat16, by torch's CPU int4 kernel."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
    return y if bias is None else y + bias


class Int4Weight:
    """One projection's int4 weight: ``packed`` (:func:`pack_int4`) and ``scales`` (scales and
    offsets, :func:`pack_int4_scales`) for :meth:`CpuKernels.linear_w4`, plus torch's packing of the
    same levels (``torch_packed``, ``torch_sz``) when its op exists (the kernel plan picks
    per step size); ``nbytes``: both copies, in bytes."""

    __slots__ = ("packed", "scales", "torch_packed", "torch_sz")

    def __init__(self, u: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> None:
        self.packed = pack_int4(u)
        self.scales = pack_int4_scales(scales, offsets)
        self.torch_packed: torch.Tensor | None = None
        self.torch_sz: torch.Tensor | None = None
        if torch_int4_available() and u.device.type == "cpu":  # a CPU-only kernel
            self.torch_packed, self.torch_sz = torch_int4_pack(u, scales, offsets)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.torch_packed is None or self.torch_sz is None else (
            self.torch_packed.numel() + 2 * self.torch_sz.numel())
        return self.packed.numel() + 2 * self.scales.numel() + extra


def quantize_weight_int4(weight: torch.Tensor,
                         exact: torch.Tensor | None = None) -> Int4Weight | None:
    """Quantize ``weight [N, K]`` in place: it becomes ``W'`` (:func:`dequantize_int4`) in its
    own dtype; returns its :class:`Int4Weight` for the decode products, or None where N is not
    a multiple of 16 (the kernel's blocks; the weight is still ``W'``). ``exact``: the same
    weight in float32 where the loader kept it (a GGUF Q4_0 tensor, de-quantized exactly), which
    is quantized on Q4_0's symmetric grid instead of the rounded ``weight``, so it keeps the
    file's levels and scales.

    Raises:
        ValueError: ``K`` not a multiple of :data:`GROUP`.
    """
    u, s, m = quantize_int4(weight if exact is None else exact, symmetric=exact is not None)
    weight.copy_(dequantize_int4(u, s, m).to(weight.dtype))
    return Int4Weight(u, s, m) if weight.shape[0] % 16 == 0 else None
