"""Decode attention on CPU in bfloat16: one new token per sequence over head-major K/V.

The decode rows of a step attend through three batched ops over ``N = R * Hkv`` small matrices
(``R`` rows, ``Hkv`` KV heads): each KV head's ``G = Hq / Hkv`` query heads are the ``G`` query
rows of one matrix, so GQA needs neither repeated K/V nor wasted score arithmetic::

    scores [N, G, S] = bias + scale * q [N, G, D] @ kt [N, D, S]      (baddbmm, q's dtype)
    probs          = softmax(scores) in float32, cast to q's dtype
    out  [N, G, D] = probs @ v [N, S, D]                              (bmm)

Keys are stored transposed (``kt``, ``[.., D, S]``) so that a sequence-length slice of a longer
buffer is still a plain strided matrix: oneDNN reads ``kt[:, :, :S]`` in place, while a slice of
``[.., S, D]`` keys transposed for the product is copied first (measured: 2.5-3x slower). Values
stay ``[.., S, D]``, which slices without copies either way.

The K/V come either from :class:`~splitserve.engine.attention.decode_kv_cache.DecodeKVCache` (no copy) or
from :func:`gather_head_major`, which copies the rows' pages out of the pool into the same layout
(or, for the C decode kernel, into its layout: keys in tiles of ``KT_TILE`` positions).
"""

from __future__ import annotations

import math

import torch

from splitserve.engine.kernels.cpu.bindings import KT_TILE
from splitserve.engine.kv_pool import KVPool


def attend(
    q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one query token per row over head-major K/V.

    Args:
        q: ``[R, Hq, D]`` queries (bfloat16 on CPU; any float dtype works).
        kt: ``[R * Hkv, D, S]`` keys, transposed; any strides oneDNN accepts (last dim unit).
        v: ``[R * Hkv, S, D]`` values.
        bias: ``[R * Hkv, 1, S]`` additive mask in ``q``'s dtype: 0 for keys to attend, ``-inf``
            for the rest; every row must attend to at least one key (else its softmax is NaN).
        scale: softmax scale, usually ``D ** -0.5``.

    Returns:
        ``[R, Hq, D]`` in ``q``'s dtype. Scores are rounded to ``q``'s dtype before the softmax
        (as transformers' eager attention does); the softmax runs in float32.
    """
    r, hq, d = q.shape
    n = kt.shape[0]
    qg = q.reshape(n, hq * r // n, d)
    scores = torch.baddbmm(bias, qg, kt, alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, v).view(r, hq, d)


def decode_bias(
    lens: list[int],
    num_keys: int,
    num_kv_heads: int,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """``[R * Hkv, 1, num_keys]``: 0 where row ``r`` attends to key position ``s`` (``s <
    lens[r]`` and, with a window, ``s > lens[r] - 1 - window``), else ``-inf``.

    A row with ``lens[r] == 0`` (an empty slot of the decode cache) attends to every key instead,
    so that its (discarded) softmax stays finite.
    """
    seq = torch.tensor(lens, dtype=torch.long, device=device)[:, None]
    kpos = torch.arange(num_keys, device=device)[None, :]
    ok = kpos < seq
    if window is not None:
        ok &= kpos > seq - 1 - window
    ok |= seq == 0
    bias = torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))
    return bias[:, None, :].expand(len(lens), num_kv_heads, num_keys).reshape(-1, 1, num_keys)


class GatherWorkspace:
    """Reused buffers for :func:`gather_head_major` (grown, never shrunk, so a steady decode
    loop allocates nothing per layer: gathering into a fresh multi-MiB tensor took ~5x as long
    as into a reused one on one core here, 0.39 vs 0.07 ms for 2.5 MB)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of at least ``numel`` elements (contents undefined)."""
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:numel]


def gather_head_major(
    pool: KVPool,
    layer: int,
    pages: torch.Tensor,
    ws: GatherWorkspace,
    dtype: torch.dtype,
    tiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the K/V of ``pages [R, P]`` (int64 page ids) at ``layer`` into the head-major layout
    :func:`attend` reads, or with ``tiled`` the one the C decode kernel reads (keys in tiles of
    ``KT_TILE`` positions, ``CpuKernels.decode_attention``).

    Returns:
        ``kt [R * Hkv, D, S]`` (``tiled``: ``[R * Hkv, S / KT_TILE, D, KT_TILE]``) and ``v [R *
        Hkv, S, D]`` in ``dtype`` (de-quantized from an 8-bit pool), views of ``ws``'s buffers
        (valid until the next call); ``S = P * page_size``, with ``tiled`` rounded up to whole
        tiles by repeating each row's first page. Positions past a row's length hold whatever
        its padding pages hold: mask them.
    """
    if tiled:
        pages = _pad_to_tiles(pages, pool.page_size)
    r, p = pages.shape
    ps, hkv, d = pool.page_size, pool.layout.num_kv_heads, pool.layout.head_dim
    s, dev = p * ps, pool.buffer.device
    flat = pages.flatten()
    numel = r * s * hkv * d
    kt = ws.get("kt", numel, dtype, dev)
    v = ws.get("v", numel, dtype, dev).view(r, hkv, s, d)
    if tiled:
        kt_dst = kt.view(r, hkv, s // KT_TILE, d, KT_TILE)
    else:
        kt_dst = kt.view(r, hkv, d, s)
    for kv, dst in ((0, kt_dst), (1, v)):
        if pool.layout.is_quantized:  # de-quantized as gathered (a fresh copy per layer)
            rows = pool.gather(layer, kv, flat, dtype).view(r, s, hkv, d)
        else:
            src = pool.k_pages(layer) if kv == 0 else pool.v_pages(layer)
            # index_select over whole pages of the 2-D view copies contiguous rows (memcpy),
            # into a reused buffer; then one transposing copy puts each KV head's positions
            # together.
            raw = ws.get(f"{kv}_raw", numel, src.dtype, dev).view(r * p, ps * hkv * d)
            torch.index_select(src.flatten(1), 0, flat, out=raw)
            rows = raw.view(r, s, hkv, d)
        if kv == 1:
            dst.copy_(rows.permute(0, 2, 1, 3))
        elif tiled:
            dst.copy_(rows.view(r, s // KT_TILE, KT_TILE, hkv, d).permute(0, 3, 1, 4, 2))
        else:
            dst.copy_(rows.permute(0, 2, 3, 1))
    kt_out = kt_dst.flatten(0, 1)
    return kt_out, v.view(r * hkv, s, d)


def _pad_to_tiles(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """``pages [R, P]`` with columns added (each row's first page again) until ``P *
    page_size`` is a multiple of ``KT_TILE``."""
    step = KT_TILE // math.gcd(page_size, KT_TILE)
    extra = -pages.shape[1] % step
    if extra == 0:
        return pages
    return torch.cat([pages, pages[:, :1].expand(-1, extra)], dim=1)
