"""glibc malloc tuning for a process that receives large ZeroMQ frames.

libzmq allocates each received frame of more than a few bytes with ``malloc`` on its I/O thread,
and the frame is freed once the KV receiver has copied it into its pool. With glibc's defaults a
buffer of a few MiB is either ``mmap``-ed fresh (above the dynamic mmap threshold) or, when freed
at the top of the heap, trimmed back to the kernel: either way the next frame faults in new,
zeroed pages — measured at 20-40% of the bytes of a 512 MiB transfer in 2 MiB messages, which
costs about as much CPU as the copy itself. Raising both thresholds keeps freed buffers in the
heap, so the next frames reuse warm memory (``bench/kv_transfer.py``; docs/performance.md, "KV transfer").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_freed_buffers(mmap_threshold: int = 64 * 2**20, trim_threshold: int = 256 * 2**20) -> bool:
    """Serve allocations below ``mmap_threshold`` bytes from the heap, and give freed heap memory
    back to the kernel only beyond ``trim_threshold`` bytes. Process-wide; call once.

    Returns:
        Whether glibc accepted both settings (False on other C libraries: nothing changed).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    if not ok:
        logger.info("mallopt refused the frame-buffer settings; received frames may fault in")
    return ok
