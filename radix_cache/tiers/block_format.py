"""A KV block's bytes in a tier: the pool's page bytes as they are (``raw``), or at 8 bits.

``--kv-host-cache-dtype int8|fp8_e4m3`` keeps host-memory (L2) blocks of a pool that stores more
bits (float32, bfloat16) in the 8-bit KV format the pool itself can use (``engine.kv_quant``:
one float32 scale per token and KV head, values then scales), so the same RAM holds about 1.9x
the tokens of a bfloat16 pool (3.8x of float32). Such a block is de-quantized as it comes back
into the pool; it is lossy, as ``--kv-cache-dtype int8`` is, and keeps its format when it is
demoted to disk (the block's header says which: ``block_codec``). A pool that is already 8-bit
keeps its own bytes everywhere.
"""

from __future__ import annotations

import dataclasses

import torch

from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.engine.kv_quant import QUANTIZED_KV, dequantize_kv, quantize_kv


def page_rows(pool: KVPool) -> torch.Tensor:
    """The pool's storage as ``uint8 [num_pages, page_bytes]`` (a view: one row per page)."""
    buf = pool.buffer
    return buf.view(buf.shape[0], -1).view(torch.uint8)


class BlockFormat:
    """Converts pool pages to one tier format and any stored format back to pool pages.

    Args:
        layout: the pool's layout.
        host_dtype: ``auto`` (the pool's bytes) or ``int8`` / ``fp8_e4m3`` (8-bit values of a
            pool that stores more bits).

    Attributes:
        fmt: the format :meth:`encode` produces (``raw`` or the 8-bit kind).
        sizes: payload bytes of one block per format this pool can read back.

    Raises:
        ValueError: an 8-bit ``host_dtype`` on a pool that is 8-bit in another kind.
    """

    def __init__(self, layout: KVLayout, host_dtype: str = "auto") -> None:
        self.layout = layout
        self.sizes = {"raw": layout.page_bytes}
        if host_dtype == "auto" or host_dtype == layout.kv_cache_dtype:
            self.fmt = "raw"
        elif layout.is_quantized:
            raise ValueError(f"kv_host_cache_dtype {host_dtype} on a {layout.kv_cache_dtype} KV "
                             "pool: use auto (the pool's 8-bit pages as they are)")
        else:
            self.fmt = host_dtype
        if not layout.is_quantized:
            for kind in QUANTIZED_KV:
                self.sizes[kind] = dataclasses.replace(layout, kv_cache_dtype=kind).page_bytes
        self._shape = (layout.num_layers, 2, layout.page_size, layout.num_kv_heads,
                       layout.head_dim)
        self._dtype = getattr(torch, layout.dtype)

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block in :attr:`fmt`."""
        return self.sizes[self.fmt]

    def encode(self, pages: torch.Tensor) -> torch.Tensor:
        """``pages``: ``uint8 [n, page_bytes]`` pool rows -> ``uint8 [n, block_bytes]`` in
        :attr:`fmt` (a new tensor on the CPU)."""
        pages = pages.cpu()
        if self.fmt == "raw":
            return pages.clone()
        n = pages.shape[0]
        x = pages.contiguous().view(self._dtype).view(n, *self._shape)
        q, scale = quantize_kv(x, self.fmt)
        return torch.cat([q.reshape(n, -1).view(torch.uint8),
                          scale.reshape(n, -1).view(torch.uint8)], dim=1)

    def decode(self, fmt: str, payload: torch.Tensor) -> torch.Tensor:
        """``payload``: ``uint8 [n, sizes[fmt]]`` -> pool rows ``uint8 [n, page_bytes]``.

        Raises:
            ValueError: a format this pool cannot read (an 8-bit block for an 8-bit pool of
                another kind).
        """
        if fmt == "raw":
            return payload
        if fmt not in self.sizes:
            raise ValueError(f"a {fmt} block cannot go into a {self.layout.kv_cache_dtype} pool")
        n = payload.shape[0]
        nv = self.layout.num_layers * 2 * self.layout.page_size * self.layout.num_kv_heads \
            * self.layout.head_dim
        values = payload[:, :nv].contiguous().view(QUANTIZED_KV[fmt]).view(n, *self._shape)
        scales = payload[:, nv:].contiguous().view(torch.float32).view(n, *self._shape[:-1])
        x = dequantize_kv(values, scales, self._dtype)
        return x.reshape(n, -1).view(torch.uint8)
