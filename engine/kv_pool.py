"""Paged KV pool: one tensor holding every page, and a free-page allocator.

Layout is page-major, ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``, so one
page (all layers' K and V for ``page_size`` tokens) is one contiguous block of memory: the unit
that KV transfer moves (DESIGN.md, "KV transfer") can be sent as a raw frame without gathering.
Page 0 is reserved as a scratch page: padded page-table entries point at it, so gathers over a
padded page table never index out of range. It is never handed out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What two workers must agree on before KV pages can move between them."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def page_bytes(self) -> int:
        """Bytes in one page: all layers, K and V."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * itemsize

    def mismatch(self, other: KVLayout) -> str | None:
        """A message naming every field that differs, or None when the layouts agree."""
        diffs = [
            f"{name}: {getattr(self, name)} here vs {getattr(other, name)} on the peer"
            for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "dtype")
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
        layout: model and page geometry.
        num_pages: pages in the pool, including the reserved scratch page 0.
        device: torch device of the buffer.
        memory: optional uint8 tensor of at least ``num_pages * layout.page_bytes`` bytes to use
            as the buffer (not zeroed) instead of a fresh allocation.
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
        shape = (num_pages, layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
        dtype = getattr(torch, layout.dtype)
        if memory is None:
            self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        else:
            # Caller-provided bytes (e.g. a shared-memory segment a peer writes into).
            self.buffer = memory.view(torch.uint8)[: num_pages * layout.page_bytes].view(dtype).view(shape)

    def k_pages(self, layer: int) -> torch.Tensor:
        """View ``[num_pages, page_size, num_kv_heads, head_dim]`` of layer ``layer``'s keys."""
        return self.buffer[:, layer, 0]

    def v_pages(self, layer: int) -> torch.Tensor:
        """View ``[num_pages, page_size, num_kv_heads, head_dim]`` of layer ``layer``'s values."""
        return self.buffer[:, layer, 1]

    def write(
        self, layer: int, page_ids: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store new tokens' K/V. ``page_ids``/``offsets``: ``[T]`` int64; ``k``/``v``: ``[T, H, D]``."""
        self.buffer[page_ids, layer, 0, offsets] = k.to(self.buffer.dtype)
        self.buffer[page_ids, layer, 1, offsets] = v.to(self.buffer.dtype)

    def read_pages(self, page_ids: list[int]) -> torch.Tensor:
        """Copy of pages ``page_ids``: ``[len(page_ids), num_layers, 2, page_size, H, D]``."""
        return self.buffer[torch.tensor(page_ids, dtype=torch.long, device=self.buffer.device)]

    def write_pages(self, page_ids: list[int], data: torch.Tensor) -> None:
        """Install whole pages (as produced by :meth:`read_pages` on a peer with the same layout;
        ``data`` may be on another device, e.g. received into host memory)."""
        idx = torch.tensor(page_ids, dtype=torch.long, device=self.buffer.device)
        self.buffer[idx] = data.to(self.buffer.device, self.buffer.dtype)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return (num_tokens + page_size - 1) // page_size
