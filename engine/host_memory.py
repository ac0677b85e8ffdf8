"""Host buffers backed by transparent huge pages, for the KV pool.

A decode step reads every running sequence's K/V of a layer: a few KiB out of each of its pages
(a page holds all layers), so over 4 KiB pages nearly every read is another TLB entry and a
long context walks far more of them than the TLB holds. On 2 MiB pages the same reads take
a few hundred entries: measured on the 8-bit pool's decode attention, batch 32 with 2k tokens
each, one thread: 3.6 ms per layer over huge pages against 5.0 over 4 KiB pages
(docs/performance.md, "8-bit KV cache").

Linux grants them per range on request (``madvise(MADV_HUGEPAGE)``, honoured in the default
``madvise`` mode of ``/sys/kernel/mm/transparent_hugepage/enabled``) to memory not yet touched.
So the buffer is a fresh anonymous mapping of its own, not memory from the allocator's heap,
which a long-lived process may have touched already; it is advised, then written once, so all
of it is committed at start as ``torch.zeros`` did (a pool larger than the memory available
fails at start, not under load later). Where the advice is refused (another OS, THP off) the
buffer is the same, on small pages.
"""

from __future__ import annotations

import logging
import mmap

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes: the x86-64 and arm64 transparent huge page


def huge_page_zeros(nbytes: int) -> torch.Tensor:
    """A zeroed ``uint8 [nbytes]`` CPU tensor starting on a 2 MiB boundary, its whole 2 MiB
    blocks advised ``MADV_HUGEPAGE``. Buffers under 2 MiB are plain ``torch.zeros``. The
    mapping (up to 2 MiB larger than ``nbytes``, for the alignment) lives as long as the tensor
    or any view of it.

    Never raises for a refused advice (logged at debug level): the memory is the same, on
    4 KiB pages.

    Raises:
        MemoryError: the mapping failed (out of address space or memory), naming the size.
    """
    if nbytes < HUGE_PAGE:
        return torch.zeros(nbytes, dtype=torch.uint8)
    # Private (Python's default for an anonymous map is shared: shmem, whose huge pages are
    # another setting, usually off), anonymous, zero-filled.
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise MemoryError(f"cannot map {nbytes / 2**20:,.0f} MiB of host memory: {e}") from e
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    base = raw.data_ptr()
    start = (base + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE - base
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice, start, nbytes // HUGE_PAGE * HUGE_PAGE)
        except OSError as e:
            log.debug("madvise(MADV_HUGEPAGE) refused: %s", e)
    return raw[start : start + nbytes].zero_()  # commit it now, on huge pages where granted
