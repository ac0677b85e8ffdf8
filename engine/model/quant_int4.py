"""Group-wise weight-only int4 (``--quantization int4``), quantized at load time.

Scheme: symmetric, groups of :data:`GROUP` = 32 consecutive input channels, one float16 scale
per group and output row: for the group ``g`` of row ``n`` of ``W [N, K]``, ``m`` is its element
of largest magnitude (signed), ``s = fp16(m / -8)`` and ``Q = clamp(round(W / s), -8, 7)``; the
served weight is ``W' = s * Q``. The largest element lands exactly on ``-8 * s`` (the full
16-level range is used; an element of the opposite sign and the same magnitude clips to 7).

Why symmetric, group 32, float16 scales:

- it is GGUF's Q4_0 block exactly (32 weights, one float16 scale, levels ``-8..7``): a Q4_0
  tensor, de-quantized in float32 (exact) and quantized here, gives back the file's own levels
  and scales bit for bit (``tests/engine/test_quant_int4.py``), so Q4_0 files serve the weights
  they hold (``engine/model/loader.py`` quantizes them from float32, not from the serving dtype);
- no zero point means no correction term per group in the integer product (one less
  operation per group and output in ``csrc/gemm_w4.c``); asymmetric Q4_K-style groups would
  need both, and their 6-bit sub-scales do not map onto one float16 scale, so Q4_K tensors are
  de-quantized and re-quantized here;
- 128-wide groups do not divide the default model's hidden size (576 = 4.5 x 128); 32 divides
  every supported model's dimensions.

Which weights: as int8 (``engine.model.quant``): every decoder ``Linear`` and the LM head, not
the token embedding. The weight parameter becomes ``W'`` in the serving dtype (oneDNN serves
prompt steps and steps above the kernel plan's crossover with it; in float32 ``W'`` is exact, so
``transformers`` loaded with ``W'`` is an exact reference); decode steps read the 4-bit copy.
"""

from __future__ import annotations

import torch

GROUP = 32  # input channels per scale
INT4_MIN, INT4_MAX = -8, 7
FP16_MAX = 65504.0


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype, ``K % GROUP == 0``) -> ``(Q [N, K] int8 in -8..7,
    s [N, K / GROUP] float16)`` (see the module docstring). An all-zero group gets ``s = 1``;
    a group whose scale underflows float16 gets ``s = 1`` too (its elements round to 0).

    Raises:
        ValueError: ``K`` not a multiple of :data:`GROUP`.
    """
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int4 weights need K % {GROUP} == 0, got K = {k}")
    g = weight.detach().float().reshape(n, k // GROUP, GROUP)
    m = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
    s = (m / -8.0).clamp(-FP16_MAX, FP16_MAX).half()
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(g / s.float()[..., None]).clamp_(INT4_MIN, INT4_MAX).to(torch.int8)
    return q.reshape(n, k), s


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``s * Q`` in float32 ``[N, K]`` (exact: a float16 times a 4-bit integer fits float32's
    mantissa): the weight the int4 model serves."""
    n, k = q.shape
    w = q.float().reshape(n, k // GROUP, GROUP) * scales.float()[..., None]
    return w.reshape(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``Q [N, K]`` int8 in -8..7 (``N % 16 == 0``, ``K % GROUP == 0``) -> ``[N / 16, K / 8,
    16, 4]`` uint8, the layout of ``csrc/gemm_w4.c``: per 16 output columns and 8 input channels
    64 bytes, byte ``4 c + j`` holding ``Q[c, 8 o + j] + 8`` in its low nibble and
    ``Q[c, 8 o + 4 + j] + 8`` in its high one, so one 64-byte load splits (an AND, a shift and
    an AND) into two vectors of 4 unsigned weights per column for ``vpdpbusd``.

    Raises:
        ValueError: N not a multiple of 16 or K not of :data:`GROUP`.
    """
    n, k = q.shape
    if n % 16 or k % GROUP:
        raise ValueError(f"int4 packing needs N % 16 == 0 and K % {GROUP} == 0, got {n} x {k}")
    u = (q.to(torch.int16) + 8).to(torch.uint8).reshape(n // 16, 16, k // 8, 2, 4)
    b = u[:, :, :, 0, :] | (u[:, :, :, 1, :] << 4)
    return b.permute(0, 2, 1, 3).contiguous()


def pack_int4_scales(scales: torch.Tensor) -> torch.Tensor:
    """``s [N, G]`` float16 -> ``[N / 16, G, 16]`` float16: a group's 16 column scales are one
    32-byte load in ``csrc/gemm_w4.c``."""
    n, groups = scales.shape
    return scales.reshape(n // 16, 16, groups).transpose(1, 2).contiguous()


def unpack_int4(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_int4` and :func:`pack_int4_scales`: ``(Q [N, K] int8,
    s [N, K / GROUP] float16)`` (for tests and tools that read a packed weight back)."""
    nb, octets = packed.shape[:2]
    b = packed.permute(0, 2, 1, 3)  # [N/16, 16, K/8, 4]
    u = torch.stack([b & 0x0F, b >> 4], dim=3)  # [N/16, 16, K/8, 2, 4]
    q = (u.to(torch.int16) - 8).to(torch.int8).reshape(nb * 16, octets * 8)
    s = scales.transpose(1, 2).reshape(nb * 16, scales.shape[1])
    return q, s


def torch_int4_pack(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same weight for torch's ``_weight_int4pack_mm_for_cpu``: ``(packed uint8 [N, K/2],
    scale_and_zero [K / GROUP, N, 2] bfloat16)``. That op takes bfloat16 scales only, so its
    weight is ``bf16(s) * Q``: within ``2^-9`` relative of ``W'`` per group (its own reference
    in the tests)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8), 1)
    st = scales.float().t()
    sz = torch.stack([st, torch.zeros_like(st)], dim=-1).bfloat16().contiguous()
    return packed, sz


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
    """One projection's int4 weight: ``packed`` (:func:`pack_int4`) and ``scales``
    (:func:`pack_int4_scales`) for :meth:`CpuKernels.linear_w4`, plus torch's packing of the
    same levels (``torch_packed``, ``torch_sz``) when its op exists (the kernel plan picks
    per step size); ``nbytes``: both copies, in bytes."""

    __slots__ = ("packed", "scales", "torch_packed", "torch_sz")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.packed = pack_int4(q)
        self.scales = pack_int4_scales(scales)
        self.torch_packed: torch.Tensor | None = None
        self.torch_sz: torch.Tensor | None = None
        if torch_int4_available() and q.device.type == "cpu":  # a CPU-only kernel
            self.torch_packed, self.torch_sz = torch_int4_pack(q, scales)

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
    weight in float32 where the loader has it (a GGUF Q4_0 tensor de-quantized exactly), which
    is quantized instead of the rounded ``weight``.

    Raises:
        ValueError: ``K`` not a multiple of :data:`GROUP`.
    """
    q, scales = quantize_int4(weight if exact is None else exact)
    weight.copy_(dequantize_int4(q, scales).to(weight.dtype))
    return Int4Weight(q, scales) if weight.shape[0] % 16 == 0 else None
