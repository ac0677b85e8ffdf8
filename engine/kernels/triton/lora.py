"""LoRA products for CUDA: Punica's SGMV (Chen et al., arXiv 2310.18547) as two Triton kernels.

A step's adapted rows come grouped by adapter slot (``forward_batch.AdapterRows``: ``rows``, the
row indices grouped by slot, and ``segments``, per group ``(slot, start in rows, count)``). For
one projection, every slot's adapter sits in two stacked buffers (``engine.lora.adapters``):
``A [slots, R, K]`` (the stacked ``lora_A`` of the modules the projection fuses, zero-padded to
``R`` ranks) and ``Bt [slots, R, N]`` (each module's ``s * B^T`` in its rows and output columns,
zeros elsewhere). Then

- the shrink: ``t[j] = x[rows[j]] @ A[slot]^T`` for every adapted row ``j``, in float32;
- the expand: ``y[rows[j]] += t[j] @ Bt[slot]``, summed in float32 and rounded once.

Each program takes one tile of one segment's rows (gathered through ``rows``), so rows of
different adapters share a launch and a base-only row costs nothing. Under Triton's CPU
interpreter (no CUDA) the tiles are computed in float32 (``UPCAST``), as in ``quant_matmul``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_R, BLOCK_K, BLOCK_N = 16, 16, 32, 64


@triton.jit
def _shrink_kernel(
    X, A, ROWS, SEGS, T, K, R, stride_x, stride_as, stride_ar, stride_t,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``T[start + m, r] = x[rows[start + m]] . A[slot, r]`` for one tile of segment
    ``program_id(0)``."""
    g = tl.program_id(0)
    slot = tl.load(SEGS + 3 * g)
    start = tl.load(SEGS + 3 * g + 1)
    count = tl.load(SEGS + 3 * g + 2)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    idx = tl.load(ROWS + start + offs_m, mask=mask_m, other=0)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < K
        x = tl.load(X + idx[:, None] * stride_x + k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(A + slot * stride_as + offs_r[None, :] * stride_ar + k[:, None],
                    mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a, input_precision="ieee")
    tl.store(T + (start + offs_m)[:, None] * stride_t + offs_r[None, :], acc,
             mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(
    T, BT, Y, ROWS, SEGS, N, R, stride_t, stride_bs, stride_br, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``y[rows[start + m], n] += T[start + m] . Bt[slot, :, n]`` for one tile of segment
    ``program_id(0)``, summed in float32 and rounded to ``y``'s dtype once."""
    g = tl.program_id(0)
    slot = tl.load(SEGS + 3 * g)
    start = tl.load(SEGS + 3 * g + 1)
    count = tl.load(SEGS + 3 * g + 2)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    idx = tl.load(ROWS + start + offs_m, mask=mask_m, other=0)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask_r = r < R
        t = tl.load(T + (start + offs_m)[:, None] * stride_t + r[None, :],
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(BT + slot * stride_bs + r[:, None] * stride_br + offs_n[None, :],
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(t, b.to(tl.float32), input_precision="ieee")
    ptrs = Y + idx[:, None] * stride_y + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + acc).to(Y.dtype.element_ty), mask=mask)


def sgmv_triton(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                rows: torch.Tensor, segments: torch.Tensor, max_count: int) -> torch.Tensor:
    """``y`` (``[T, N]``, updated in place) plus the LoRA products of the adapted rows.

    Args:
        x: ``[T, K]``, last dim contiguous.
        y: ``[T, N]`` contiguous, the projection's base output.
        a: ``[slots, R, K]`` stacked ``A`` per slot (contiguous).
        bt: ``[slots, R, N]`` stacked ``s * B^T`` per slot (contiguous).
        rows: ``[M]`` int64 adapted rows grouped by slot, on ``x``'s device.
        segments: ``[G, 3]`` int64 ``(slot, start in rows, count)``, on ``x``'s device.
        max_count: the largest ``count`` (sizes the grid).
    """
    num_groups = segments.shape[0]
    if num_groups == 0 or max_count == 0:
        return y
    k, n, r = x.shape[1], y.shape[1], a.shape[1]
    t = torch.empty(rows.shape[0], r, dtype=torch.float32, device=x.device)
    upcast = x.device.type != "cuda"
    m_blocks = triton.cdiv(max_count, BLOCK_M)
    _shrink_kernel[(num_groups, m_blocks, triton.cdiv(r, BLOCK_R))](
        x, a, rows, segments, t, k, r, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
        UPCAST=upcast, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )
    _expand_kernel[(num_groups, m_blocks, triton.cdiv(n, BLOCK_N))](
        t, bt, y, rows, segments, n, r, t.stride(0), bt.stride(0), bt.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N,
    )
    return y
