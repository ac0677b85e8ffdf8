"""Triton paged decode attention: one new query token per sequence against its paged K/V.

Follows the split-K design of FlashDecoding (Dao et al., 2023) as SGLang's grouped Triton decode
kernel applies it to a paged cache; this is our own code. Stage 1 runs one program per
(sequence, KV head, split): the ``G = Hq / Hkv`` query heads that share a KV head are the rows of
one tile (padded to 16, the smallest ``tl.dot`` size), so each K/V block is loaded once for the
whole group; each split keeps an online softmax (FlashAttention-2) over its token range and writes
a normalised partial output and its log-sum-exp. Stage 2 merges the splits per (sequence, head).
With one split, stage 1 writes the final output directly.

K/V are read straight from the pool's per-layer views through the page table, one block at a
time by ``paged_tile.attend_paged_block``, the loop body the extend kernel shares.
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

BLOCK_N = 64  # tokens per K/V block


@triton.jit
def _decode_stage1(
    Q, K, V, KS, VS, Out, Partial, Lse, PageTable, TokIdx, Rows, SeqLens,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_sp, stride_ss, stride_sh, stride_ot, stride_oh, stride_pt,
    scale_log2, window, page_size, head_dim, group, num_splits,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, KV_QUANT: tl.constexpr, KV_DTYPE: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    tok = tl.load(TokIdx + b)
    row = tl.load(Rows + b)
    # The attended range [lo, seq_len): everything, or the last `window` positions.
    lo = seq_len * 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * group + offs_h
    mask_h = offs_h < group
    mask_d = offs_d < head_dim
    q = tl.load(
        Q + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:  # the CPU interpreter has no bfloat16 arithmetic: compute in float32 there
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + offs_n
        mask_n = t < end
        # Every block inside [start, end) has a valid token, so m_i stays finite.
        m_i, l_i, acc = attend_paged_block(
            q, m_i, l_i, acc, K, V, KS, VS, PageTable, row, kvh, t, mask_n, mask_n[None, :],
            offs_d, mask_d, stride_pt, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, stride_sp, stride_ss, stride_sh, scale_log2, page_size, UPCAST, IEEE,
            KV_QUANT, KV_DTYPE,
        )

    # An empty split (short sequence, many splits) has l_i == 0: output 0 and weight 0 (lse -inf).
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = acc / safe_l[:, None]
    out_mask = mask_h[:, None] & mask_d[None, :]
    if ONE_SPLIT:
        tl.store(
            Out + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(Out.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partial is [Bd, Hq, num_splits, BLOCK_D] float32, Lse [Bd, Hq, num_splits], contiguous.
        hq = heads * 0 + tl.num_programs(1) * group
        base = (b * hq + heads) * num_splits + split
        tl.store(Partial + base[:, None] * BLOCK_D + offs_d[None, :], o, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(Lse + base, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    Out, Partial, Lse, TokIdx, stride_ot, stride_oh, head_dim, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    hq = tl.num_programs(1)
    tok = tl.load(TokIdx + b)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    base = (b * hq + h) * num_splits + offs_s
    lse = tl.load(Lse + base, mask=mask_s, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # at least one split is non-empty, so the max is finite
    o = tl.load(
        Partial + base[:, None] * BLOCK_D + offs_d[None, :], mask=mask_s[:, None], other=0.0
    )
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        Out + tok * stride_ot + h * stride_oh + offs_d,
        o.to(Out.dtype.element_ty),
        mask=offs_d < head_dim,
    )


def decode_attention(
    q: torch.Tensor,
    kv: PagedKV,
    out: torch.Tensor,
    page_table: torch.Tensor,
    tok_idx: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int,
    scale: float,
    window: int | None,
    upcast: bool,
) -> None:
    """Write ``out[tok_idx[b]]`` = attention of ``q[tok_idx[b]]`` over sequence ``b``'s K/V.

    Args:
        q: ``[T, Hq, D]`` queries (any strides with a unit last stride), float32/bfloat16/float16.
        kv: one layer's K/V views of the pool (``[num_pages, page_size, Hkv, D]``; an 8-bit
            pool's with its scales, de-quantized as read).
        out: ``[T, Hq, D]`` output, written only at the rows ``tok_idx``.
        page_table: ``[B, max_pages]`` int64 page ids.
        tok_idx: ``[Bd]`` int64 row of each decode sequence's token in ``q``/``out``.
        rows: ``[Bd]`` int64 row of each decode sequence in ``page_table``.
        seq_lens: ``[Bd]`` int32 KV length (including the new token, already written).
        num_splits: token-range splits per sequence (more = more parallelism on short batches).
        scale: softmax scale.
        window: sliding window (attend to the last ``window`` positions) or None.
        upcast: compute in float32 (needed under the CPU interpreter).
    """
    bd = tok_idx.numel()
    if bd == 0:
        return
    _, hq, d = q.shape
    _, page_size, hkv, _ = kv.k.shape
    group = hq // hkv
    block_d = max(MIN_DOT, triton.next_power_of_2(d))
    one = num_splits == 1
    if one:
        partial = lse = out  # unused by the kernel when ONE_SPLIT
    else:
        partial = torch.empty((bd, hq, num_splits, block_d), dtype=torch.float32, device=q.device)
        lse = torch.empty((bd, hq, num_splits), dtype=torch.float32, device=q.device)
    _decode_stage1[(bd, hkv, num_splits)](
        q, kv.k, kv.v, kv.k_scales, kv.v_scales, out, partial, lse, page_table, tok_idx, rows, seq_lens,
        q.stride(0), q.stride(1), *kv.k.stride()[:3], *kv.v.stride()[:3],
        *kv.k_scales.stride()[:3], out.stride(0), out.stride(1), page_table.stride(0),
        scale * LOG2E, window or 0, page_size, d, group, num_splits,
        BLOCK_H=max(MIN_DOT, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        UPCAST=upcast, IEEE=q.dtype == torch.float32, KV_QUANT=kv.quant, KV_DTYPE=kv.tl_dtype,
        ONE_SPLIT=one,
    )  # fmt: skip
    if not one:
        _decode_stage2[(bd, hq)](
            out, partial, lse, tok_idx, out.stride(0), out.stride(1), d, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )  # fmt: skip


def choose_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Splits per sequence: enough programs to fill a large GPU (~132 SMs, a few programs each)
    when the batch is small, never a split shorter than two K/V blocks, at most 16."""
    want = triton.cdiv(512, max(1, batch_size * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_seq_len, 2 * BLOCK_N), 16))
