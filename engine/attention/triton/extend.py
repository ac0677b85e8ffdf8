"""Triton paged extend attention: a run of new tokens per sequence over its cached prefix + itself.

FlashAttention-2 (Dao, 2023) forward with the K/V side read through the page table, in the spirit
of SGLang's Triton extend kernel; our own code. One program per (sequence, query head, block of
``BLOCK_M`` new tokens) keeps an online softmax over the sequence's keys. Because the backend
writes the new tokens' K/V into the pool first, prefix and new keys are read the same way (SGLang
reads the new part from the dense k/v instead; one path is simpler and the prefill is
compute-bound), one block at a time by ``paged_tile.attend_paged_block``, the loop body the
decode kernel shares. New token ``i`` sits at position ``p = seq_len - extend_len + i`` and sees
keys ``j <= p`` (and ``j > p - window`` with a sliding window); blocks entirely after the causal
edge or before the window are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.attention.triton.paged_tile import (
    LOG2E,
    MIN_DOT,
    PagedKV,
    attend_paged_block,
)


@triton.jit
def _extend_kernel(
    Q, K, V, KS, VS, Out, PageTable, TokStart, ExtendLens, SeqLens, Rows,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_sp, stride_ss, stride_sh, stride_ot, stride_oh, stride_pt,
    scale_log2, window, page_size, head_dim, group,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, KV_QUANT: tl.constexpr, KV_DTYPE: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    extend_len = tl.load(ExtendLens + e)
    if m0 < extend_len:  # the grid covers the longest run; shorter ones have idle blocks
        seq_len = tl.load(SeqLens + e)
        tok0 = tl.load(TokStart + e)
        row = tl.load(Rows + e)
        kvh = h // group
        prefix = seq_len - extend_len
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < extend_len
        mask_d = offs_d < head_dim
        qpos = prefix + offs_m
        q = tl.load(
            Q + (tok0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        if UPCAST:  # the CPU interpreter has no bfloat16 arithmetic: compute in float32 there
            q = q.to(tl.float32)
        # Keys this block can see: [lo, hi), with hi at the causal edge of its last query.
        hi = tl.minimum(seq_len, prefix + m0 + BLOCK_M)
        lo = hi * 0
        if window > 0:
            lo = tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N * BLOCK_N

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            t = n0 + offs_n
            mask_n = t < hi
            see = mask_n[None, :] & (t[None, :] <= qpos[:, None])
            if window > 0:
                see = see & (t[None, :] > qpos[:, None] - window)
            # A row may see nothing in this block (padding rows, window edges): the helper
            # keeps its running max finite for exp2, so it adds 0, not NaN.
            m_i, l_i, acc = attend_paged_block(
                q, m_i, l_i, acc, K, V, KS, VS, PageTable, row, kvh, t, mask_n, see, offs_d, mask_d,
                stride_pt, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                stride_sp, stride_ss, stride_sh, scale_log2, page_size, UPCAST, IEEE,
                KV_QUANT, KV_DTYPE,
            )

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every real row sees at least itself
        tl.store(
            Out + (tok0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            o.to(Out.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def extend_attention(
    q: torch.Tensor,
    kv: PagedKV,
    out: torch.Tensor,
    page_table: torch.Tensor,
    tok_start: torch.Tensor,
    extend_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    max_extend_len: int,
    scale: float,
    window: int | None,
    upcast: bool,
) -> None:
    """Write ``out`` rows of each extending sequence: causal attention over its whole K/V.

    Args:
        q: ``[T, Hq, D]`` queries (any strides with a unit last stride), float32/bfloat16/float16.
        kv: one layer's K/V views of the pool (``[num_pages, page_size, Hkv, D]``; an 8-bit
            pool's with its scales, de-quantized as read), already holding the new tokens.
        out: ``[T, Hq, D]`` output, written only at the extending sequences' rows.
        page_table: ``[B, max_pages]`` int64 page ids.
        tok_start: ``[Be]`` int32 first row of each sequence's new tokens in ``q``/``out``.
        extend_lens: ``[Be]`` int32 new tokens per sequence.
        seq_lens: ``[Be]`` int32 KV length after this step (prefix + new).
        rows: ``[Be]`` int64 row of each sequence in ``page_table``.
        max_extend_len: ``max(extend_lens)`` (host int: sizes the grid without a device sync).
        scale: softmax scale.
        window: sliding window or None.
        upcast: compute in float32 (needed under the CPU interpreter).
    """
    be = tok_start.numel()
    if be == 0:
        return
    _, hq, d = q.shape
    _, page_size, hkv, _ = kv.k.shape
    block_d = max(MIN_DOT, triton.next_power_of_2(d))
    # float32 tiles take twice the registers/shared memory of 16-bit ones on a GPU.
    block = 32 if q.dtype == torch.float32 or block_d > 128 else 64
    grid = (be, hq, triton.cdiv(max_extend_len, block))
    _extend_kernel[grid](
        q, kv.k, kv.v, kv.k_scales, kv.v_scales, out, page_table, tok_start, extend_lens, seq_lens, rows,
        q.stride(0), q.stride(1), *kv.k.stride()[:3], *kv.v.stride()[:3],
        *kv.k_scales.stride()[:3], out.stride(0), out.stride(1), page_table.stride(0),
        scale * LOG2E, window or 0, page_size, d, hq // hkv,
        BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d,
        UPCAST=upcast, IEEE=q.dtype == torch.float32, KV_QUANT=kv.quant, KV_DTYPE=kv.tl_dtype,
    )  # fmt: skip
