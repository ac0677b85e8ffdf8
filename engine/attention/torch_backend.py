"""The torch attention backend: paged attention with torch ops on any device, with C kernels
for CPU bfloat16 (decode rows and prefill extends) and a contiguous decode KV cache
(:mod:`~splitserve.engine.attention.decode_kv_cache`). The interface is
:class:`~splitserve.engine.attention.base.BaseAttentionBackend`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitserve.engine.attention.base import BaseAttentionBackend, SlidingWindows, layer_windows
from splitserve.engine.attention.decode_attention import (
    GatherWorkspace,
    attend,
    decode_bias,
    gather_head_major,
)
from splitserve.engine.attention.decode_kv_cache import DecodeKVCache, DecodePlan, StepTargets
from splitserve.engine.forward_batch import ForwardBatch
from splitserve.engine.kernels.cpu.bindings import KT_TILE, CpuKernels
from splitserve.engine.kernels.cpu.build import load_cpu_kernels
from splitserve.engine.kv_pool import KVPool, pages_for


@dataclass(slots=True)
class _Extend:
    """One sequence with more than one new token (looped over; prefill is compute-bound)."""

    start: int  # first new token's index into T
    extend_len: int
    seq_len: int
    pages: torch.Tensor  # [pages_for(seq_len)] int64
    # SDPA's [extend_len, seq_len] bool mask per sliding window (True = attend; None = plain
    # causal), built on the first layer with that window that needs it: the C kernel takes the
    # window instead.
    sdpa_masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        if window not in self.sdpa_masks:
            self.sdpa_masks[window] = _extend_mask(
                self.extend_len, self.seq_len, window, self.pages.device
            )
        return self.sdpa_masks[window]


@dataclass(slots=True)
class TorchAttentionMetadata:
    """Decode rows (one new token) go through one batched call; the rest are looped.

    Masks are kept per distinct sliding window (``windows`` has each layer's): a model whose
    layers alternate between a window and none builds two of each, not one per layer.
    """

    batch: ForwardBatch
    windows: tuple[int | None, ...]  # each layer's sliding window (None: none)
    decode_tokens: torch.Tensor | None  # [Bd] token indices into T; None when no decode rows
    decode_pages: torch.Tensor | None  # [Bd, P] int64 page ids
    # [Bd, 1, 1, P * page_size] bool per window, None = attend to all (float32 SDPA path).
    decode_masks: dict[int | None, torch.Tensor | None]
    extends: list[_Extend]
    is_decode_only: bool
    # Head-major path (bfloat16): the step's masks, and the decode cache's plan when it serves.
    decode_biases: dict[int | None, torch.Tensor] | None = None  # [Bd * Hkv, 1, P * ps] (gather)
    decode_plan: DecodePlan | None = None
    # The C decode kernel (gather path, or an 8-bit pool read in place): each row's KV length.
    decode_lens: torch.Tensor | None = None  # [Bd] int64
    # Decode rows read the 8-bit pool where it is (``decode_attention_q8.c``): no decode cache,
    # no gather, no masks.
    decode_in_pool: bool = False


def _joining(batch: ForwardBatch) -> list[tuple[int, int]]:
    """``(length after the step, most KV it can reach)`` of the step's prompt rows that will
    decode afterwards: the decode cache reserves room for them in this step."""
    bounds = batch.max_seq_lens
    if bounds is None:
        return []
    return [
        (n, bound) for n, bound, chunk in zip(batch.seq_lens, bounds, batch.extend_lens)
        if chunk > 1 and bound > n
    ]


# Decode rows attend head-major (decode_attention.attend) in bfloat16: three batched ops per
# layer with no wasted score arithmetic, over K/V the decode cache holds in place or that one
# gather copies out of the pool. Float32 keeps the SDPA path, so greedy-vs-transformers numerics
# are unchanged there.
def _use_head_major(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16


class TorchAttentionBackend(BaseAttentionBackend):
    """Paged attention with torch ops on any device; the fast path is CPU bfloat16 decode.

    Extends (prefill chunks) on CPU in bfloat16 run the C flash kernel over the pool's pages
    (``csrc/extend_attention.c``); elsewhere they gather their sequence's pages and call
    ``scaled_dot_product_attention``. Decode rows in bfloat16 read a
    :class:`~splitserve.engine.attention.decode_kv_cache.DecodeKVCache` when the batch carries sequence
    ids (a worker's batches do), else gather; the cache is this backend's only state between
    batches and is never the source of truth (bounded by the pool's own size).

    Args:
        use_decode_cache: keep the decode KV cache (False: gather decode K/V from the pool).
        use_cpu_kernels: call the C kernels where they serve (False: torch ops only).
    """

    def __init__(self, use_decode_cache: bool = True, use_cpu_kernels: bool = True) -> None:
        self.decode_cache: DecodeKVCache | None = None
        self.use_decode_cache = use_decode_cache
        self.use_cpu_kernels = use_cpu_kernels
        self.workspace = GatherWorkspace()
        self.kernels: CpuKernels | None = None  # loaded on the first CPU bfloat16 decode step
        self._kernels_checked = False

    def prepare(
        self, batch: ForwardBatch, pool: KVPool, sliding_window: SlidingWindows
    ) -> TorchAttentionMetadata:
        device = batch.input_ids.device
        ps = pool.page_size
        windows = layer_windows(sliding_window, pool.layout.num_layers)
        distinct = list(dict.fromkeys(windows))
        dec_rows, dec_tok, extends = [], [], []
        start = 0
        for i, (n, seq_len) in enumerate(zip(batch.extend_lens, batch.seq_lens, strict=True)):
            if n == 1:
                dec_rows.append(i)
                dec_tok.append(start)
            elif n > 1:
                pages = batch.page_table[i, : pages_for(seq_len, ps)]
                extends.append(_Extend(start, n, seq_len, pages))
            start += n
        meta = TorchAttentionMetadata(
            batch, windows, None, None, {}, extends, len(dec_rows) == len(batch.extend_lens)
        )
        if not dec_rows:
            # Nothing decodes: the cache keeps (or makes) room only for the prompts that will.
            joining, cache = _joining(batch), self.decode_cache
            if cache is None and joining and _use_head_major(pool.dtype):
                cache = self._decode_cache_for(pool, batch)
            if cache is not None:
                cache.hold(joining)
            return meta
        lens = [batch.seq_lens[i] for i in dec_rows]
        num_pages = pages_for(max(lens), ps)
        if meta.is_decode_only:
            meta.decode_pages = batch.page_table[:, :num_pages]
        else:
            rows = torch.tensor(dec_rows, dtype=torch.long, device=device)
            meta.decode_pages = batch.page_table[rows, :num_pages]
            meta.decode_tokens = torch.tensor(dec_tok, dtype=torch.long, device=device)
        if not _use_head_major(pool.dtype):
            meta.decode_masks = {
                w: _decode_mask(lens, num_pages * ps, w, device) for w in distinct
            }
            return meta
        cache = self._decode_cache_for(pool, batch)
        if cache is not None:
            ids = [batch.seq_ids[i] for i in dec_rows]  # type: ignore[index]
            bounds = batch.max_seq_lens
            max_lens = None if bounds is None else [bounds[i] for i in dec_rows]
            meta.decode_plan = cache.plan(
                ids, lens, meta.decode_pages, distinct, max_lens, _joining(batch)
            )
        if self.kernels_for(pool) is not None:
            meta.decode_lens = torch.tensor(lens, dtype=torch.long, device=device)
        meta.decode_in_pool = self.reads_pool_in_place(pool)
        if meta.decode_plan is None and not meta.decode_in_pool:
            meta.decode_biases = {
                w: decode_bias(
                    lens, num_pages * ps, pool.layout.num_kv_heads, w, pool.dtype, device
                )
                for w in distinct
            }
        return meta

    def cache_bytes(self) -> int:
        cache = self.decode_cache
        return 0 if cache is None else cache.nbytes

    def reads_pool_in_place(self, pool: KVPool, num_heads: int | None = None) -> bool:
        """Whether decode rows over ``pool`` attend straight from its pages: an 8-bit pool the
        C kernels serve (``decode_attention_q8.c``), for which no decode cache is kept (a
        bfloat16 copy would spend the memory the 8 bits save)."""
        return (pool.layout.is_quantized and pool.buffer.is_contiguous()
                and self.kernels_for(pool, num_heads) is not None)

    def serves_fused_decode(self, pool: KVPool, num_heads: int) -> bool:
        """The fused C decode layers read and append this backend's decode cache (so it must be
        on) or, over an 8-bit pool, read the pool in place (:meth:`reads_pool_in_place`); and
        they write the pool as its KV append does (bfloat16 or 8-bit, contiguous)."""
        if self.reads_pool_in_place(pool, num_heads):
            return True
        return (self.use_decode_cache and self.kernels_for(pool, num_heads) is not None
                and pool.buffer.is_contiguous())

    def fused_decode_targets(self, meta: TorchAttentionMetadata) -> StepTargets | None:
        """The decode cache's slots for ``meta``'s rows (``DecodeKVCache.append_all_targets``),
        or, over an 8-bit pool read in place, the rows' page table and lengths; None where the
        cache did not plan the step (off, no sequence ids, over its memory bound) or the step
        is not decode-only."""
        if meta.decode_in_pool and meta.is_decode_only:
            assert meta.decode_pages is not None and meta.decode_lens is not None
            return StepTargets(None, None, None, None, meta.decode_lens, meta.decode_pages)
        plan, cache = meta.decode_plan, self.decode_cache
        if (not meta.is_decode_only or plan is None or cache is None or cache.kt is None
                or cache.v is None or not cache.tiled):
            return None
        return cache.append_all_targets(plan)

    def kernels_for(self, pool: KVPool, num_heads: int | None = None) -> CpuKernels | None:
        """The C decode kernel when it serves ``pool`` (CPU, read back in bfloat16, supported
        heads; ``num_heads`` query heads, unchecked when None), else None. Built on the first
        call (about half a second), then cached. Its decode attention reads the decode cache or
        a gathered copy of a bfloat16 pool, and an 8-bit pool in place
        (:meth:`reads_pool_in_place`, de-quantizing in registers); the KV append and the fused
        decode layers write 8-bit pages as the pool does (``kv_quant.c``) and the extend
        attention de-quantizes pages as it reads them."""
        if pool.buffer.device.type != "cpu" or pool.dtype != torch.bfloat16:
            return None
        hkv = pool.layout.num_kv_heads
        if not CpuKernels.supports(num_heads or hkv, hkv, pool.layout.head_dim):
            return None
        if not self._kernels_checked:
            self.kernels = load_cpu_kernels() if self.use_cpu_kernels else None
            self._kernels_checked = True
        return self.kernels

    def _decode_cache_for(self, pool: KVPool, batch: ForwardBatch) -> DecodeKVCache | None:
        """The decode cache of ``pool`` (made on first use), or None when off, when the batch
        has no sequence ids to key it by, or for an 8-bit pool read in place."""
        if (not self.use_decode_cache or batch.seq_ids is None or pool.buffer.device.type != "cpu"
                or self.reads_pool_in_place(pool)):
            return None
        if self.decode_cache is None or self.decode_cache.pool is not pool:
            # Never more than the pool's own bytes: an 8-bit pool's cache (in the model's
            # dtype) holds about half as many tokens as the pool before the step gathers.
            pool_bytes = pool.buffer.numel() * pool.buffer.element_size()
            # Keys in the C kernels' tiles wherever they read the cache.
            tiled = self.kernels_for(pool) is not None
            self.decode_cache = DecodeKVCache(pool, max_bytes=pool_bytes, tiled=tiled)
        return self.decode_cache

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        meta: TorchAttentionMetadata,
        pool: KVPool,
        scale: float,
    ) -> torch.Tensor:
        batch = meta.batch
        if meta.is_decode_only and self._append_with_kernel(k, v, layer, meta, pool):
            return self._decode_head_major(q, k, v, layer, meta, pool, scale, appended=True)
        if not self._append_with_kernel(k, v, layer, meta, pool, to_cache=False):
            pool.write(layer, batch.out_page_ids, batch.out_offsets, k, v)
        if meta.is_decode_only:
            return self._decode(q, k, v, layer, meta, pool, scale)
        out = torch.empty_like(q)
        if meta.decode_pages is not None:
            dt = meta.decode_tokens
            out[dt] = self._decode(q[dt], k[dt], v[dt], layer, meta, pool, scale)
        for e in meta.extends:
            end = e.start + e.extend_len
            out[e.start : end] = self._extend(
                q[e.start : end], k[e.start : end], v[e.start : end], e, layer, pool, scale,
                meta.windows,
            )
        return out

    def _append_with_kernel(
        self, k: torch.Tensor, v: torch.Tensor, layer: int, meta: TorchAttentionMetadata,
        pool: KVPool,
        to_cache: bool = True,
    ) -> bool:
        """Write the step's new K/V into the pool and, for a decode-only step with
        ``to_cache``, the decode cache (when it serves) with one C call, as
        :meth:`KVPool.write` (8-bit pools: about 6x faster than its torch ops) and
        ``DecodeKVCache.append`` would; False (nothing written) where the C kernels do not
        apply."""
        kern = self.kernels_for(pool)
        if kern is None or k.dtype != pool.dtype or not pool.buffer.is_contiguous():
            return False
        d = k.shape[2]
        if k.stride(2) != 1 or k.stride(1) != d:
            k = k.contiguous()
        if v.stride(2) != 1 or v.stride(1) != d:
            v = v.contiguous()
        plan, cache = meta.decode_plan, self.decode_cache
        if not to_cache:
            plan = cache = None
        targets = None
        if plan is not None and cache is not None and cache.tiled:
            targets = cache.append_targets(layer, plan)
        batch = meta.batch
        kern.kv_append(k, v, pool, layer, batch.out_page_ids, batch.out_offsets, targets)
        if plan is not None and cache is not None and targets is None:
            cache.append(layer, plan, k, v)  # a cache in the torch products' layout
        return True

    def _decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        meta: TorchAttentionMetadata,
        pool: KVPool,
        scale: float,
    ) -> torch.Tensor:
        """``q [Bd, Hq, D]`` (and the rows' new ``k``/``v [Bd, Hkv, D]``, already in the pool),
        one token per sequence -> ``[Bd, Hq, D]``."""
        bd, hq, d = q.shape
        hkv = pool.layout.num_kv_heads
        pages = meta.decode_pages
        if _use_head_major(pool.dtype):
            return self._decode_head_major(q, k, v, layer, meta, pool, scale)
        mask = meta.decode_masks[meta.windows[layer]]
        # [Bd * P, page_size, Hkv, D] -> [Bd, S, Hkv, D] -> [Bd, Hkv, S, D]
        kc = pool.gather(layer, 0, pages, q.dtype).view(bd, -1, hkv, d).transpose(1, 2)
        vc = pool.gather(layer, 1, pages, q.dtype).view(bd, -1, hkv, d).transpose(1, 2)
        # GQA without repeating K/V: the G query heads sharing a KV head become G "query rows"
        # of that head (all at the same position, so one [S] mask serves them all).
        qg = q.reshape(bd, hkv, hq // hkv, d)
        o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask, scale=scale)
        return o.reshape(bd, hq, d)

    def _decode_head_major(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        meta: TorchAttentionMetadata,
        pool: KVPool,
        scale: float,
        appended: bool = False,
    ) -> torch.Tensor:
        """Decode rows over the decode cache (in place) or over a head-major gather;
        ``appended``: the new K/V are already in the cache (``_append_with_kernel``)."""
        dtype = pool.dtype
        qc = q.to(dtype)
        window = meta.windows[layer]
        plan, cache = meta.decode_plan, self.decode_cache
        kern = self.kernels_for(pool, q.shape[1])
        if kern is not None and (qc.stride(2) != 1 or qc.stride(1) != qc.shape[2]):
            qc = qc.contiguous()
        if plan is not None and cache is not None and kern is None and cache.tiled:
            # Heads the C kernel does not take, a cache in its tiles: keep it, attend a gather.
            if not appended:
                cache.append(layer, plan, k, v)
            plan = cache = None
        if meta.decode_in_pool and kern is not None:
            assert meta.decode_pages is not None and meta.decode_lens is not None
            out = torch.empty(qc.shape, dtype=dtype, device=qc.device)
            kern.decode_attention_q8(
                qc, pool, layer, meta.decode_pages, meta.decode_lens, window, scale, out
            )
            return out.to(q.dtype)
        if plan is None or cache is None:
            assert meta.decode_pages is not None
            if meta.decode_biases is None:  # an 8-bit pool, heads the C kernel does not take
                assert meta.decode_lens is not None
                lens, keys = meta.decode_lens.tolist(), meta.decode_pages.shape[1] * pool.page_size
                hkv = pool.layout.num_kv_heads
                meta.decode_biases = {
                    w: decode_bias(lens, keys, hkv, w, dtype, qc.device) for w in set(meta.windows)
                }
            pages, ws = meta.decode_pages, self.workspace
            kt, vv = gather_head_major(pool, layer, pages, ws, dtype, tiled=kern is not None)
            if kern is not None:
                assert meta.decode_lens is not None
                r, hkv, d = qc.shape[0], pool.layout.num_kv_heads, qc.shape[2]
                kt, vv = kt.view(r, hkv, -1, d, KT_TILE), vv.view(r, hkv, -1, d)
                slots = torch.arange(r, device=qc.device)
                out = torch.empty(qc.shape, dtype=dtype, device=qc.device)
                kern.decode_attention(qc, kt, vv, slots, meta.decode_lens, window, scale, out)
                return out.to(q.dtype)
            return attend(qc, kt, vv, meta.decode_biases[window], scale).to(q.dtype)
        if not appended:
            cache.append(layer, plan, k, v)
        if kern is not None and cache.tiled:
            kt, vv = cache.slot_views(layer)
            out = torch.empty(qc.shape, dtype=dtype, device=qc.device)
            kern.decode_attention(qc, kt, vv, plan.slots, plan.lens, window, scale, out)
            return out.to(q.dtype)
        if plan.shares_slots:
            return _attend_shared_slots(qc, cache, layer, plan, window, scale).to(q.dtype)
        kt, vv = cache.views(layer, plan)
        bias = plan.biases[window]
        if plan.is_identity:
            return attend(qc, kt, vv, bias, scale).to(q.dtype)
        # Rows sit at their slots; free slots in between compute rows that are dropped.
        qs = qc.new_zeros(plan.num_slots, *qc.shape[1:]).index_copy_(0, plan.slots, qc)
        out = attend(qs, kt, vv, bias, scale)
        return out.index_select(0, plan.slots).to(q.dtype)

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        e: _Extend,
        layer: int,
        pool: KVPool,
        scale: float,
        windows: tuple[int | None, ...],
    ) -> torch.Tensor:
        """One sequence's ``q [n, Hq, D]`` against its whole KV -> ``[n, Hq, D]``: the C flash
        kernel on CPU bfloat16 (it reads the pool, where ``k``/``v`` already are; an 8-bit
        pool's pages de-quantized as read), else SDPA; ``windows[layer]`` is the layer's
        sliding window."""
        kern = self.kernels_for(pool, q.shape[1])
        window = windows[layer]
        if (
            kern is not None and kern.has_gemm  # the kernel needs AVX512-BF16, as the tiles do
            and q.dtype == torch.bfloat16 and pool.buffer.is_contiguous()
        ):
            if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
                q = q.contiguous()
            pages = e.pages.contiguous()  # a row of the page table: already, in practice
            if pool.layout.is_quantized:
                out = kern.extend_attention_q8(q, pool, layer, pages, e.seq_len, window, scale)
            else:
                out = kern.extend_attention(q, pool.buffer, layer, pages, e.seq_len, window, scale)
            if out is not None:
                return out
        if e.seq_len == e.extend_len:
            # No cached prefix: the new K/V are the whole sequence (rounded through the pool,
            # its dtype or its 8 bits, so that this path and the gather path see the same values).
            kc, vc = pool.round_trip(k).to(q.dtype), pool.round_trip(v).to(q.dtype)
        else:
            shape = (-1, k.shape[1], k.shape[2])
            kc = pool.gather(layer, 0, e.pages, q.dtype).view(shape)[: e.seq_len]
            vc = pool.gather(layer, 1, e.pages, q.dtype).view(shape)[: e.seq_len]
        mask = e.mask(window)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            kc.transpose(0, 1).unsqueeze(0),
            vc.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)


def _attend_shared_slots(
    q: torch.Tensor, cache: DecodeKVCache, layer: int, plan: DecodePlan, window: int | None,
    scale: float,
) -> torch.Tensor:
    """``q [Bd, Hq, D]`` of decode rows some of which share a slot (one sequence's drafted
    positions, ``ForwardBatch.as_decode_rows``) -> ``[Bd, Hq, D]``, with torch ops: each row
    over its own copy of its slot's K/V, masked at its own length. Scattering q to slots, as
    the other rows do, would put a sequence's rows on one. A copy per row per layer is slow;
    the runner gives rows that share a slot only to the fused C path, so this serves only
    callers that build such batches where the C kernels are off."""
    kt_all, v_all = cache.slot_views(layer)  # [slots, Hkv, D, cap], [slots, Hkv, cap, D]
    hkv = kt_all.shape[1]
    kt = kt_all.index_select(0, plan.slots).flatten(0, 1)
    vv = v_all.index_select(0, plan.slots).flatten(0, 1)
    bias = decode_bias(plan.lens.tolist(), plan.num_keys, hkv, window, q.dtype, q.device)
    return attend(q, kt, vv, bias, scale)


def _extend_mask(
    n: int, seq_len: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """``[n, seq_len]`` bool: new token ``i`` (position ``prefix + i``) sees keys ``j <= prefix + i``
    and, with a window, ``j > prefix + i - window``. None when plain ``is_causal`` is the same."""
    prefix = seq_len - n
    if prefix == 0 and (window is None or window >= seq_len):
        return None
    qpos = torch.arange(prefix, seq_len, device=device).unsqueeze(1)
    kpos = torch.arange(seq_len, device=device).unsqueeze(0)
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def _decode_mask(
    lens: list[int], num_keys: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """``[B, 1, 1, num_keys]`` bool: keys ``< seq_len`` (and inside the window) of each row."""
    if window is None and all(n == num_keys for n in lens):
        return None
    seq = torch.tensor(lens, dtype=torch.long, device=device).unsqueeze(1)
    kpos = torch.arange(num_keys, device=device).unsqueeze(0)
    mask = kpos < seq
    if window is not None:
        mask &= kpos > seq - 1 - window
    return mask[:, None, None, :]

