"""The cores of one host shared by its workers, step by step.

A local launch splits a host's cores between its worker processes (``ClusterConfig.roles``): on
2 cores a disaggregated cluster runs prefill on one thread and decode on the other. For one user
that halves decode: while it decodes, the prefill worker has nothing to do, and the other way
round while a prompt is prefilled. With a core share the launcher gives every worker of the host
one byte of a small shared file (``launch.local``); a worker marks its byte before each engine
step and clears it when it has no work left, and each step runs on the host's threads divided
by the workers busy at that moment (at least one). So one busy worker takes every core and two
busy workers split them as before; between hosts nothing is shared.

Off by default (``--share-cores`` turns it on): on a host busy with other work, a step's extra
threads wait on each other at every barrier, and decode measured 3-6x slower than on the fixed
split (docs/performance.md).

The count is read before each step, so a worker that turns busy during another's step shares
the cores from its next step on: for at most one step the host runs more threads than cores. A
worker killed inside a step leaves its byte marked: the launcher clears it when it restarts the
worker (and a worker that is not restarted keeps the others on their floor share, as before the
core share).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path

import torch


def create_core_share(path: Path, slots: int) -> None:
    """Create (or clear) the share file: ``slots`` zero bytes, one per worker of the host."""
    path.write_bytes(bytes(slots))


def clear_core_share_slot(path: Path, slot: int) -> None:
    """Mark worker ``slot`` idle from outside (the launcher, before it restarts a worker that was
    killed inside a step and so never cleared its byte)."""
    with open(path, "r+b") as f:
        f.seek(slot)
        f.write(b"\0")


class CoreShare:
    """One worker's view of its host's share file.

    Args:
        path: the file :func:`create_core_share` made.
        slot: this worker's byte in it (``0 <= slot < slots``).
        host_threads: the threads every worker of the host may use in all (its cores).
        set_threads: applies a thread count (default ``torch.set_num_threads``, which OpenMP,
            oneDNN and the C kernels follow; tests pass a recorder).

    Raises:
        ValueError: ``slot`` outside the file, or ``host_threads`` < 1.
        OSError: the file cannot be opened or mapped.
    """

    def __init__(self, path: str | Path, slot: int, host_threads: int,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        if host_threads < 1:
            raise ValueError(f"host_threads must be at least 1, not {host_threads}")
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        slots = len(self._map)
        if not 0 <= slot < slots:
            self._map.close()
            raise ValueError(f"core-share slot {slot} outside a file of {slots} slots")
        self.slot = slot
        self.host_threads = host_threads
        self._set_threads = set_threads
        self.threads = 0  # the count last applied (0: none yet)

    def busy_workers(self) -> int:
        """How many workers of the host have marked themselves busy (this one included once it
        did)."""
        return len(self._map) - self._map[:].count(0)

    def busy(self) -> int:
        """Mark this worker busy and apply its share for the coming step: ``host_threads //``
        the busy workers, at least 1. Returns the thread count."""
        self._map[self.slot] = 1
        threads = max(1, self.host_threads // self.busy_workers())
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
        return threads

    def idle(self) -> None:
        """Mark this worker idle (no step to run): the others may take its cores."""
        self._map[self.slot] = 0

    def close(self) -> None:
        """Mark idle and unmap the file."""
        if not self._map.closed:
            self.idle()
            self._map.close()
