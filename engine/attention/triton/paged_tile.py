"""The loop body both Triton kernels share: one block of keys read through the page table and
folded into a tile of queries' online softmax (FlashAttention-2's inner loop, Dao 2023).

Token ``t`` of a sequence lives at page ``page_table[row, t // page_size]``, slot
``t % page_size`` of the pool's per-layer K/V views (strided, not contiguous). Scores are in
base 2 (``scale_log2`` = softmax scale * log2(e)), so ``exp2`` stands for ``exp``.

An 8-bit pool (``--kv-cache-dtype int8|fp8_e4m3``, ``engine/kv_quant.py``) is read de-quantized
as each block is loaded: value times its token's and head's float32 scale, rounded to the
model's dtype, exactly as ``KVPool.gather`` computes it for the torch backend. fp8 values arrive
as their raw bytes and are decoded here with integer ops (e4m3fn: 1 sign, 4 exponent bits with
bias 7, 3 mantissa bits, no infinities), so no GPU float8 support and no interpreter float8 type
is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitserve.engine.kv_pool import KVPool

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))
MIN_DOT = 16  # smallest M/N/K that tl.dot accepts on GPUs
# KV_QUANT codes: how the pool stores K/V values.
KV_PLAIN, KV_INT8, KV_FP8 = 0, 1, 2


@triton.jit
def _fp8_e4m3_to_f32(raw):
    """Raw e4m3fn bytes (uint8) -> float32, exact (every e4m3fn value is a float32)."""
    bits = raw.to(tl.int32)
    sign = (bits >> 7) & 1
    exp = (bits >> 3) & 15
    man = bits & 7
    normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    subnormal = man.to(tl.float32) * 0.001953125  # man * 2**-9
    return tl.where(exp == 0, tl.where(sign == 1, -subnormal, subnormal), normal)


@triton.jit
def _load_kv_block(
    X, XS, page, slot, kvh, offs_d, kv_mask, mask_n, stride_p, stride_s, stride_h,
    stride_sp, stride_ss, stride_sh, KV_QUANT: tl.constexpr, KV_DTYPE: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_N, BLOCK_D]`` K or V values of one block, in the pool's dtype, or de-quantized
    to ``KV_DTYPE`` (the model's) from an 8-bit pool with scales ``XS``."""
    x = tl.load(
        X + page[:, None] * stride_p + slot[:, None] * stride_s + kvh * stride_h
        + offs_d[None, :],
        mask=kv_mask,
        other=0,
    )
    if KV_QUANT != 0:
        s = tl.load(XS + page * stride_sp + slot * stride_ss + kvh * stride_sh, mask=mask_n,
                    other=0.0)  # fmt: skip
        if KV_QUANT == 1:
            xf = x.to(tl.float32)
        else:
            xf = _fp8_e4m3_to_f32(x)
        x = (xf * s[:, None]).to(KV_DTYPE)
    return x


@triton.jit
def attend_paged_block(
    q, m_i, l_i, acc, K, V, KS, VS, PageTable, row, kvh, t, mask_n, see, offs_d, mask_d,
    stride_pt, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_sp, stride_ss, stride_sh, scale_log2, page_size,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, KV_QUANT: tl.constexpr, KV_DTYPE: tl.constexpr,
):  # fmt: skip
    """Fold keys ``t`` (``[BLOCK_N]`` positions; ``mask_n``: inside the sequence's range) of
    KV head ``kvh`` into the running softmax of the query tile ``q`` (``[BLOCK_M, BLOCK_D]``).

    Args:
        m_i, l_i: ``[BLOCK_M]`` float32 running max (base 2) and sum of exponentials.
        acc: ``[BLOCK_M, BLOCK_D]`` float32 unnormalised output.
        see: which (query, key) pairs count, broadcastable to ``[BLOCK_M, BLOCK_N]`` (the caller's
            causal and window rules; ``mask_n`` included).
        KS, VS: an 8-bit pool's float32 scale views of this layer's K and V, strides
            ``stride_sp/ss/sh`` (page, slot, head); unused when ``KV_QUANT`` is ``KV_PLAIN``.
        KV_QUANT: ``KV_PLAIN``, ``KV_INT8`` or ``KV_FP8`` (``K``/``V`` then hold raw bytes).
        KV_DTYPE: the model's dtype, which de-quantized values are rounded to.
        UPCAST: compute in float32 (the CPU interpreter has no bfloat16 arithmetic).
        IEEE: float32 products without TF32 rounding, so results match the torch backend.

    Returns:
        The updated ``(m_i, l_i, acc)``. A row that sees nothing yet keeps ``m_i == -inf`` and
        adds nothing (its running max is taken as 0 for ``exp2``, giving 0 instead of NaN).
    """
    page = tl.load(PageTable + row * stride_pt + t // page_size, mask=mask_n, other=0)
    slot = t % page_size
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = _load_kv_block(
        K, KS, page, slot, kvh, offs_d, kv_mask, mask_n, stride_kp, stride_ks, stride_kh,
        stride_sp, stride_ss, stride_sh, KV_QUANT, KV_DTYPE,
    )  # fmt: skip
    v = _load_kv_block(
        V, VS, page, slot, kvh, offs_d, kv_mask, mask_n, stride_vp, stride_vs, stride_vh,
        stride_sp, stride_ss, stride_sh, KV_QUANT, KV_DTYPE,
    )  # fmt: skip
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


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True, slots=True)
class PagedKV:
    """One layer's K/V pages as the kernels read them.

    Attributes:
        k, v: ``[num_pages, page_size, Hkv, D]`` views of the pool: the model's dtype, or an
            8-bit pool's raw values (int8; fp8 as uint8 bytes).
        k_scales, v_scales: ``float32 [num_pages, page_size, Hkv]`` views (8-bit pools; else
            ``k``/``v`` again, never read).
        quant: ``KV_PLAIN``, ``KV_INT8`` or ``KV_FP8``.
        dtype: the model's dtype, which de-quantized values are rounded to.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor
    v_scales: torch.Tensor
    quant: int
    dtype: torch.dtype

    @classmethod
    def of(cls, pool: KVPool, layer: int) -> PagedKV:
        """Layer ``layer`` of ``pool`` (any ``kv_cache_dtype``)."""
        if pool.scales is None:
            k, v = pool.k_pages(layer), pool.v_pages(layer)
            return cls(k, v, k, v, KV_PLAIN, pool.dtype)
        k, v = pool.kv[:, layer, 0], pool.kv[:, layer, 1]
        quant = KV_INT8
        if k.dtype != torch.int8:  # fp8: the kernels decode the raw bytes themselves
            k, v, quant = k.view(torch.uint8), v.view(torch.uint8), KV_FP8
        return cls(k, v, pool.scales[:, layer, 0], pool.scales[:, layer, 1], quant, pool.dtype)

    @property
    def tl_dtype(self) -> tl.dtype:
        """``dtype`` as Triton's type (the ``KV_DTYPE`` constexpr)."""
        return _TL_DTYPES[self.dtype]
