"""Paged KV pool: one tensor holding every page, and a free-page allocator.

Layout is page-major, ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``, so one
page (all layers' K and V for ``page_size`` tokens) is one contiguous block of memory: the unit
that KV transfer moves (docs/design.md, "KV transfer") can be sent as a raw frame without gathering.
Page 0 is reserved as a scratch page: padded page-table entries point at it, so gathers over a
padded page table never index out of range. It is never handed out.

An 8-bit pool (``KVLayout.kv_cache_dtype`` int8 or fp8_e4m3, :mod:`~splitserve.engine.kv_quant`)
keeps the same rule: one page is one contiguous block of bytes, its values
``[num_layers, 2, page_size, num_kv_heads, head_dim]`` (1 byte each) followed by their scales
``[num_layers, 2, page_size, num_kv_heads]`` (float32), so every transfer backend moves the
scales with the pages without knowing they exist. ``buffer`` is then ``uint8 [num_pages,
page_bytes]``; ``kv`` and ``scales`` are views into it. Readers de-quantize through
:meth:`KVPool.gather` / :meth:`KVPool.gather_pages`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.host_memory import huge_page_zeros
from splitserve.engine.kv_quant import (
    QUANTIZED_KV,
    SCALE_BYTES,
    SCALE_DTYPE,
    dequantize_kv,
    quantize_kv,
    round_trip_kv,
)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What two workers must agree on before KV pages can move between them."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str  # "float32" | "bfloat16" | "float16": the model's, in which K/V are read back
    kv_cache_dtype: str = "auto"  # "auto" (stored in ``dtype``) | "int8" | "fp8_e4m3"

    @property
    def is_quantized(self) -> bool:
        """True for an 8-bit pool (values plus per-token-and-head scales)."""
        return self.kv_cache_dtype != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype K/V values are stored in."""
        if self.is_quantized:
            return QUANTIZED_KV[self.kv_cache_dtype]
        return getattr(torch, self.dtype)

    @property
    def value_bytes(self) -> int:
        """Bytes of one page's K/V values (all layers), scales not counted."""
        itemsize = torch.empty((), dtype=self.storage_dtype).element_size()
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes in one page: all layers, K and V (and their scales in an 8-bit pool)."""
        if not self.is_quantized:
            return self.value_bytes
        scale_count = self.num_layers * 2 * self.page_size * self.num_kv_heads
        return self.value_bytes + scale_count * SCALE_BYTES

    @property
    def bytes_per_token(self) -> float:
        """KV bytes one token takes in the pool (all layers, K and V, scales included)."""
        return self.page_bytes / self.page_size

    def mismatch(self, other: KVLayout) -> str | None:
        """A message naming every field that differs, or None when the layouts agree."""
        names = ("num_layers", "num_kv_heads", "head_dim", "page_size", "dtype", "kv_cache_dtype")
        diffs = [
            f"{name}: {getattr(self, name)} here vs {getattr(other, name)} on the peer"
            for name in names
            if getattr(self, name) != getattr(other, name)
        ]
        return "KV layout mismatch (" + "; ".join(diffs) + ")" if diffs else None


class PageAllocator:
    """Free list of page ids ``1..num_pages-1`` (page 0 is the reserved scratch page).

    Check-then-act: call :meth:`can_alloc` before :meth:`alloc` so a caller never half-commits.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._is_free = [False] + [True] * (num_pages - 1)

    @property
    def num_free(self) -> int:
        """Pages available to :meth:`alloc`."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages handed out and not yet freed (the scratch page is not counted)."""
        return self.num_pages - 1 - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Hand out ``n`` page ids.

        Raises:
            MemoryError: fewer than ``n`` pages are free (callers should check :meth:`can_alloc`).
        """
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool.

        Raises:
            ValueError: a page is the scratch page, out of range, or already free (double free).
        """
        for p in pages:
            if p <= 0 or p >= self.num_pages or self._is_free[p]:
                raise ValueError(f"bad free of page {p} (reserved, out of range or already free)")
            self._is_free[p] = True
            self._free.append(p)


class KVPool:
    """The KV cache of one worker: ``buffer`` plus its :class:`PageAllocator`.

    Args:
        layout: model and page geometry (and ``kv_cache_dtype``: an 8-bit pool).
        num_pages: pages in the pool, including the reserved scratch page 0.
        device: torch device of the buffer.
        memory: optional uint8 tensor of at least ``num_pages * layout.page_bytes`` bytes to use
            as the buffer (not zeroed) instead of a fresh allocation. A fresh CPU buffer sits on
            transparent huge pages where the OS grants them (:mod:`~splitserve.engine.host_memory`).

    Attributes:
        buffer: the pool's storage, one row per page, each page's bytes contiguous (what KV
            transfer moves): ``[num_pages, num_layers, 2, page_size, Hkv, D]`` in the model's
            dtype, or ``uint8 [num_pages, page_bytes]`` for an 8-bit pool.
        kv: the stored values, ``[num_pages, num_layers, 2, page_size, Hkv, D]`` in
            ``layout.storage_dtype`` (``buffer`` itself unless 8-bit).
        scales: ``float32 [num_pages, num_layers, 2, page_size, Hkv]`` (8-bit pools), else None.
        dtype: the dtype K/V are read back in (the model's).
    """

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        device: str | torch.device = "cpu",
        memory: torch.Tensor | None = None,
    ) -> None:
        self.layout = layout
        self.page_size = layout.page_size
        self.allocator = PageAllocator(num_pages)
        self.dtype = getattr(torch, layout.dtype)
        shape = (num_pages, layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
        self.scales: torch.Tensor | None = None
        if memory is None and torch.device(device).type == "cpu":
            memory = huge_page_zeros(num_pages * layout.page_bytes)
        if not layout.is_quantized:
            if memory is None:
                self.buffer = torch.zeros(shape, dtype=self.dtype, device=device)
            else:
                # Caller-provided bytes (e.g. a shared-memory segment a peer writes into).
                raw = memory.view(torch.uint8)[: num_pages * layout.page_bytes]
                self.buffer = raw.view(self.dtype).view(shape)
            self.kv = self.buffer
            return
        if memory is None:
            self.buffer = torch.zeros(
                num_pages, layout.page_bytes, dtype=torch.uint8, device=device
            )
        else:
            raw = memory.view(torch.uint8)[: num_pages * layout.page_bytes]
            self.buffer = raw.view(num_pages, layout.page_bytes)
        nv = layout.value_bytes
        self.kv = self.buffer[:, :nv].view(layout.storage_dtype).view(shape)
        self.scales = self.buffer[:, nv:].view(SCALE_DTYPE).view(shape[:-1])

    def k_pages(self, layer: int) -> torch.Tensor:
        """View ``[num_pages, page_size, num_kv_heads, head_dim]`` of layer ``layer``'s keys.

        Raises:
            TypeError: an 8-bit pool (its values mean nothing without their scales: use
                :meth:`gather`).
        """
        return self._values(layer, 0)

    def v_pages(self, layer: int) -> torch.Tensor:
        """View ``[num_pages, page_size, num_kv_heads, head_dim]`` of layer ``layer``'s values.

        Raises:
            TypeError: an 8-bit pool (use :meth:`gather`).
        """
        return self._values(layer, 1)

    def _values(self, layer: int, kv: int) -> torch.Tensor:
        if self.scales is not None:
            raise TypeError(
                f"a {self.layout.kv_cache_dtype} KV pool is read de-quantized through "
                "KVPool.gather; this reader takes raw pages"
            )
        return self.buffer[:, layer, kv]

    def write(
        self, layer: int, page_ids: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store new tokens' K/V. ``page_ids``/``offsets``: ``[T]`` int64; ``k``/``v``: ``[T, H, D]``
        (an 8-bit pool quantizes them, one scale per token and head)."""
        if self.scales is None:
            self.buffer[page_ids, layer, 0, offsets] = k.to(self.buffer.dtype)
            self.buffer[page_ids, layer, 1, offsets] = v.to(self.buffer.dtype)
            return
        for i, x in ((0, k), (1, v)):
            q, scale = quantize_kv(x, self.layout.kv_cache_dtype)
            self.kv[page_ids, layer, i, offsets] = q
            self.scales[page_ids, layer, i, offsets] = scale

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., D]`` as this pool would read it back, in ``x``'s dtype (rounded through
        the stored dtype, or quantized and de-quantized), bit for bit as :meth:`gather` gives."""
        if self.scales is None:
            return x.to(self.buffer.dtype).to(x.dtype)
        return round_trip_kv(x, self.layout.kv_cache_dtype)

    def gather(
        self, layer: int, kv: int, page_ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Copy of layer ``layer``'s keys (``kv`` 0) or values (1) of pages ``page_ids`` (any
        shape, int64), de-quantized: ``[page_ids.numel(), page_size, Hkv, D]`` in ``dtype``.

        ``index_select`` over the 2-D view copies whole contiguous rows; advanced indexing
        copies element by element and is ~6x slower on CPU.
        """
        ids = page_ids.flatten()
        shape = (ids.numel(), *self.kv.shape[3:])
        vals = self.kv[:, layer, kv].flatten(1).index_select(0, ids).view(shape)
        if self.scales is None:
            return vals.to(dtype)
        scales = self.scales[:, layer, kv].flatten(1).index_select(0, ids).view(shape[:-1])
        return dequantize_kv(vals, scales, dtype)

    def gather_pages(self, page_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Every layer's K/V of pages ``page_ids [n]`` (int64), de-quantized:
        ``[n, num_layers, 2, page_size, Hkv, D]`` in ``dtype``."""
        shape = (page_ids.numel(), *self.kv.shape[1:])
        vals = self.kv.flatten(1).index_select(0, page_ids).view(shape)
        if self.scales is None:
            return vals.to(dtype)
        scales = self.scales.flatten(1).index_select(0, page_ids).view(shape[:-1])
        return dequantize_kv(vals, scales, dtype)

    def read_pages(self, page_ids: list[int]) -> torch.Tensor:
        """Copy of pages ``page_ids`` as stored: ``[len(page_ids), *buffer.shape[1:]]`` (an
        8-bit pool's rows are raw bytes: values and scales)."""
        return self.buffer[torch.tensor(page_ids, dtype=torch.long, device=self.buffer.device)]

    def write_pages(self, page_ids: list[int], data: torch.Tensor) -> None:
        """Install whole pages (as produced by :meth:`read_pages` on a peer with the same layout;
        ``data`` may be on another device, e.g. received into host memory)."""
        idx = torch.tensor(page_ids, dtype=torch.long, device=self.buffer.device)
        self.buffer[idx] = data.to(self.buffer.device, self.buffer.dtype)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return (num_tokens + page_size - 1) // page_size
