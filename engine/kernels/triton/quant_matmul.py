"""Weight-only int8 and int4 products for CUDA: ``y [M, N] = x [M, K] @ W'[N, K].T (+ bias)``.

``W'`` is the served (de-quantized) weight of ``--quantization int8`` / ``int4``
(``engine.model.quant``, ``engine.model.quant_int4``); the kernels read only its quantized form
and de-quantize in registers, so the device holds (and each decode step reads) 1 (plus 4 bytes per row) or 0.625 bytes
per weight instead of 2 (bfloat16) or 4 (float32).

int8 (:class:`TritonInt8Weight`): ``Q [N, K]`` int8 as ``quantize_int8`` returns it and
``s [N]`` float32. The K loop multiplies ``x`` by ``Q`` (exact in bfloat16/float16: levels are
``-127..127``) into a float32 accumulator; the scale is applied once per output column after the
loop: ``y[m, n] = s[n] * sum_k x[m, k] Q[n, k]``.

int4 (:class:`TritonInt4Weight`), this module's layout, built at load by :func:`pack_int4_gpu`
from ``quantize_int4``'s ``(U [N, K] in 0..15, s, m [N, K / 32] float16)``:

- ``packed [K / 2, N]`` uint8: for group ``g`` (input channels ``32 g .. 32 g + 31``) and
  ``j`` in ``0..15``, byte ``[16 g + j, n]`` holds ``U[n, 32 g + j]`` in its low nibble and
  ``U[n, 32 g + 16 + j]`` in its high one;
- ``scales``, ``offsets [K / 32, N]`` float16.

N is the contiguous axis everywhere, so the ``[16, BLOCK_N]`` byte tile of one group and its
``[BLOCK_N]`` scales and offsets are row-contiguous (coalesced) loads; the low nibbles are the
group's first 16 input channels and the high nibbles its last 16, so each half is one
``tl.dot`` with 16 contiguous columns of ``x`` and needs no interleaving. One group per K step
(``BLOCK_K`` = 32): the tile is de-quantized as ``s * U + m`` in float32 (``s * U`` is exact, so
this is the same value as ``dequantize_int4``), rounded to ``x``'s dtype (the value a bfloat16
model's ``W'`` parameter holds) and multiplied into a float32 accumulator.

Under Triton's CPU interpreter (``x`` not on CUDA: the only way Triton runs there) there is no
bfloat16 arithmetic, so tiles are computed in float32 after rounding the weight to ``x``'s dtype
(``UPCAST``); float32 products use ``input_precision="ieee"`` (no TF32) so they match torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 32  # input channels per int4 scale: engine.model.quant_int4.GROUP (checked by the tests)
MIN_DOT = 16  # smallest M/N/K tl.dot accepts on GPUs
BLOCK_N = 64
BLOCK_K_INT8 = 64


@triton.jit
def _w8_kernel(
    X, Q, S, B, Y, M, N, K, stride_xm, stride_qn, stride_ym,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``y``; the ``[BLOCK_K, BLOCK_N]`` tile of ``Q.T`` is
    read straight from ``Q [N, K]`` (row stride ``stride_qn``)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        x = tl.load(
            X + offs_m[:, None] * stride_xm + k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        q = tl.load(
            Q + offs_n[None, :] * stride_qn + k[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0,
        )
        if UPCAST:  # the CPU interpreter has no bfloat16 arithmetic: compute in float32 there
            x = x.to(tl.float32)
            w = q.to(tl.float32)
        else:
            w = q.to(x.dtype)  # -127..127: exact in bfloat16 and float16
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    acc = acc * tl.load(S + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Y + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(Y.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _w4_kernel(
    X, P, S, O, B, Y, M, N, K, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``y``, one group of 32 input channels per step (the
    layout is in the module docstring)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, 16)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(K // 32):
        x_rows = X + offs_m[:, None] * stride_xm + g * 32 + offs_j[None, :]
        x_lo = tl.load(x_rows, mask=mask_m[:, None], other=0.0)
        x_hi = tl.load(x_rows + 16, mask=mask_m[:, None], other=0.0)
        b = tl.load(
            P + (g * 16 + offs_j)[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0
        )
        s = tl.load(S + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        m = tl.load(O + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        w_lo = (b & 0x0F).to(tl.float32) * s + m
        w_hi = (b >> 4).to(tl.float32) * s + m
        if UPCAST:  # round as the served weight does, then compute in float32
            w_lo = w_lo.to(Y.dtype.element_ty).to(tl.float32)
            w_hi = w_hi.to(Y.dtype.element_ty).to(tl.float32)
            x_lo = x_lo.to(tl.float32)
            x_hi = x_hi.to(tl.float32)
        else:
            w_lo = w_lo.to(x_lo.dtype)
            w_hi = w_hi.to(x_lo.dtype)
        if IEEE:
            acc += tl.dot(x_lo, w_lo, input_precision="ieee")
            acc += tl.dot(x_hi, w_hi, input_precision="ieee")
        else:
            acc += tl.dot(x_lo, w_lo)
            acc += tl.dot(x_hi, w_hi)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Y + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(Y.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight takes {k}")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _block_m(m: int) -> int:
    return max(MIN_DOT, min(64, triton.next_power_of_2(m)))


class TritonInt8Weight:
    """An int8 weight for :func:`_w8_kernel`: ``q [N, K]`` int8 and ``scales [N]`` float32
    (``engine.model.quant.quantize_int8``'s output, on the CUDA device); ``nbytes`` their size."""

    __slots__ = ("q", "scales")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        if q.dtype != torch.int8 or q.dim() != 2 or scales.shape != (q.shape[0],):
            raise ValueError(
                f"int8 weight needs q [N, K] int8 and scales [N], got "
                f"{tuple(q.shape)} {q.dtype} and {tuple(scales.shape)}"
            )
        self.q = q.contiguous()
        self.scales = scales.float().contiguous()

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``."""
        return tuple(self.q.shape)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scales.numel()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K]`` bfloat16, float16 or float32 -> ``x @ (s[:, None] * Q).T + bias``,
        ``[..., N]`` in ``x``'s dtype (float32 accumulation).

        Raises:
            ValueError: ``x``'s last dimension is not K.
        """
        n, k = self.q.shape
        x2 = _rows(x, k)
        m = x2.shape[0]
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m:
            block_m = _block_m(m)
            grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
            _w8_kernel[grid](
                x2, self.q, self.scales, bias if bias is not None else self.scales, y, m, n, k,
                x2.stride(0), self.q.stride(0), y.stride(0),
                HAS_BIAS=bias is not None, UPCAST=x.device.type != "cuda",
                IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                BLOCK_K=BLOCK_K_INT8,
            )  # fmt: skip
        return y.reshape(*x.shape[:-1], n)


def pack_int4_gpu(
    u: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_int4``'s ``(U [N, K] uint8 in 0..15, s, m [N, K / 32] float16)`` -> this
    module's layout: ``(packed [K / 2, N] uint8, scales [K / 32, N], offsets [K / 32, N]
    float16)`` (module docstring).

    Raises:
        ValueError: K not a multiple of 32, or mismatched shapes.
    """
    n, k = u.shape
    if k % GROUP or scales.shape != (n, k // GROUP) or offsets.shape != scales.shape:
        raise ValueError(
            f"int4 weight needs U [N, K] (K % {GROUP} == 0) and s, m [N, K / "
            f"{GROUP}], got {tuple(u.shape)}, {tuple(scales.shape)}, "
            f"{tuple(offsets.shape)}"
        )
    v = u.to(torch.uint8).reshape(n, k // GROUP, 2, 16)
    b = v[:, :, 0, :] | (v[:, :, 1, :] << 4)  # [N, G, 16]
    packed = b.reshape(n, k // 2).t().contiguous()
    return packed, scales.half().t().contiguous(), offsets.half().t().contiguous()


def unpack_int4_gpu(
    packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_int4_gpu`: ``(U [N, K] uint8, s, m [N, K / 32] float16)``."""
    half_k, n = packed.shape
    b = packed.t().reshape(n, half_k // 16, 1, 16)
    u = torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, 2 * half_k)
    return u, scales.t().contiguous(), offsets.t().contiguous()


class TritonInt4Weight:
    """An int4 weight for :func:`_w4_kernel`, in :func:`pack_int4_gpu`'s layout, built from
    ``quantize_int4``'s ``(U, s, m)`` on the CUDA device; ``nbytes`` its size (``K / 2 + K / 8``
    bytes per output row: 0.625 bytes per weight)."""

    __slots__ = ("k", "n", "offsets", "packed", "scales")

    def __init__(self, u: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> None:
        self.n, self.k = u.shape
        self.packed, self.scales, self.offsets = pack_int4_gpu(u, scales, offsets)

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``."""
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 2 * (self.scales.numel() + self.offsets.numel())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K]`` bfloat16, float16 or float32 -> ``x @ W'.T + bias`` with ``W' = s * U
        + m``, ``[..., N]`` in ``x``'s dtype (float32 accumulation).

        Raises:
            ValueError: ``x``'s last dimension is not K.
        """
        x2 = _rows(x, self.k)
        m = x2.shape[0]
        y = torch.empty(m, self.n, dtype=x.dtype, device=x.device)
        if m:
            block_m = _block_m(m)
            grid = (triton.cdiv(m, block_m), triton.cdiv(self.n, BLOCK_N))
            _w4_kernel[grid](
                x2, self.packed, self.scales, self.offsets,
                bias if bias is not None else self.scales, y, m, self.n, self.k,
                x2.stride(0), y.stride(0),
                HAS_BIAS=bias is not None, UPCAST=x.device.type != "cuda",
                IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
            )  # fmt: skip
        return y.reshape(*x.shape[:-1], self.n)
