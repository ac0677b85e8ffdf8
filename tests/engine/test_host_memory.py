"""The KV pool's host buffer (``engine/host_memory.py``): zeroed, 2 MiB aligned, the size asked
for, and backed by transparent huge pages where this Linux grants them on ``madvise``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve.engine.host_memory import HUGE_PAGE, huge_page_zeros
from splitserve.engine.kv_pool import KVLayout, KVPool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kib(addr: int) -> int:
    """``AnonHugePages`` of the mapping of this process that holds ``addr``, in KiB."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_buffer_is_zeroed_aligned_and_sized() -> None:
    for nbytes in (1000, HUGE_PAGE + 123, 5 * HUGE_PAGE):
        buf = huge_page_zeros(nbytes)
        assert buf.dtype == torch.uint8 and buf.numel() == nbytes and buf.is_contiguous()
        assert not buf.any()
        if nbytes >= HUGE_PAGE:
            assert buf.data_ptr() % HUGE_PAGE == 0


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are off (or not Linux)")
def test_a_cpu_pool_sits_on_huge_pages() -> None:
    """A 16 MiB 8-bit pool, once written: the kernel backs its aligned blocks with 2 MiB pages
    (what the decode attention's TLB needs); a pool of bfloat16 pages the same."""
    for kind in ("int8", "auto"):
        layout = KVLayout(30, 3, 64, 16, "bfloat16", kind)
        pool = KVPool(layout, (16 << 20) // layout.page_bytes)
        pool.buffer.view(torch.uint8).view(-1)[::4096] = 1  # fault every page in, as writes do
        assert _anon_huge_kib(pool.buffer.data_ptr()) >= 2048, kind


def test_a_pool_larger_than_the_address_space_fails_at_start_naming_its_size() -> None:
    with pytest.raises(MemoryError, match="cannot map 1,073,741,824 MiB"):
        huge_page_zeros(2**50)
