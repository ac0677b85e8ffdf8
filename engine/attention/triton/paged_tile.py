"""The loop body both Triton kernels share: one block of keys read through the page table and
folded into a tile of queries' online softmax (FlashAttention-2's inner loop, Dao 2023).

Token ``t`` of a sequence lives at page ``page_table[row, t // page_size]``, slot
``t % page_size`` of the pool's per-layer K/V views (strided, not contiguous). Scores are in
base 2 (``scale_log2`` = softmax scale * log2(e)), so ``exp2`` stands for ``exp``.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))
MIN_DOT = 16  # smallest M/N/K that tl.dot accepts on GPUs


@triton.jit
def attend_paged_block(
    q, m_i, l_i, acc, K, V, PageTable, row, kvh, t, mask_n, see, offs_d, mask_d,
    stride_pt, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    scale_log2, page_size,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Fold keys ``t`` (``[BLOCK_N]`` positions; ``mask_n``: inside the sequence's range) of
    KV head ``kvh`` into the running softmax of the query tile ``q`` (``[BLOCK_M, BLOCK_D]``).

    Args:
        m_i, l_i: ``[BLOCK_M]`` float32 running max (base 2) and sum of exponentials.
        acc: ``[BLOCK_M, BLOCK_D]`` float32 unnormalised output.
        see: which (query, key) pairs count, broadcastable to ``[BLOCK_M, BLOCK_N]`` (the caller's
            causal and window rules; ``mask_n`` included).
        UPCAST: compute in float32 (the CPU interpreter has no bfloat16 arithmetic).
        IEEE: float32 products without TF32 rounding, so results match the torch backend.

    Returns:
        The updated ``(m_i, l_i, acc)``. A row that sees nothing yet keeps ``m_i == -inf`` and
        adds nothing (its running max is taken as 0 for ``exp2``, giving 0 instead of NaN).
    """
    page = tl.load(PageTable + row * stride_pt + t // page_size, mask=mask_n, other=0)
    slot = t % page_size
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(
        K + page[:, None] * stride_kp + slot[:, None] * stride_ks + kvh * stride_kh
        + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V + page[:, None] * stride_vp + slot[:, None] * stride_vs + kvh * stride_vh
        + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(see, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv
