"""The cores of one host shared by its workers, step by step.

A local launch splits a host's cores between its worker processes (``ClusterConfig.roles``): on
2 cores a disaggregated cluster runs prefill on one thread and decode on the other. For one user
that halves decode: while it decodes, the prefill worker has nothing to do, and the other way
round while a prompt is prefilled. With a core share the launcher gives every worker of the host
one byte of a small shared file (``launch.local``); a worker marks its byte before each engine
step and clears it when it has no work left, and each step runs on the host's threads divided
by the workers busy at that moment (at least one). So one busy worker takes every core and two
busy workers split them as before; between hosts nothing is shared.

On by default (``--no-share-cores`` turns it off), and guarded: on a host busy with other
work, a step's extra threads wait on each other at every barrier (decode measured 3-8x slower
than on the fixed split, docs/performance.md), so a worker takes more than its floor share (the
fixed split) only while Linux reports the host's CPU pressure (PSI, ``/proc/pressure/cpu``: the
share of the last 10 s in which some runnable task waited for a CPU) at or below
:data:`MAX_PRESSURE` (:class:`CpuPressure`). Where there is no reading (a kernel without PSI)
it cannot tell a busy host from a quiet one, and keeps the floor share.

The count is read before each step, so a worker that turns busy during another's step shares
the cores from its next step on: for at most one step the host runs more threads than cores. A
worker killed inside a step leaves its byte marked: the launcher clears it when it restarts the
worker (and a worker that is not restarted keeps the others on their floor share, as before the
core share).
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

PRESSURE_FILE = Path("/proc/pressure/cpu")
# Percent of the last 10 s with some task waiting for a CPU above which a worker keeps its floor
# share. A quiet 2-core host serving one user through a disaggregated cluster with the share
# measured 9-13% (32% for a few seconds while the cluster started); the same host with a test
# run and a busy loop per core beside the workers 55-95% (docs/performance.md).
MAX_PRESSURE = 30.0


def create_core_share(path: Path, slots: int) -> None:
    """Create (or clear) the share file: ``slots`` zero bytes, one per worker of the host."""
    path.write_bytes(bytes(slots))


class CpuPressure:
    """The host's CPU pressure from Linux PSI (``some avg10`` of ``/proc/pressure/cpu``: the
    percent of the last 10 s in which at least one runnable task waited for a CPU), re-read at
    most every ``interval_s`` (a step asks before it runs).

    Args:
        path: the PSI file (tests pass their own).
        interval_s: seconds a reading is reused.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, path: Path = PRESSURE_FILE, interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.interval_s = interval_s
        self._clock = clock
        self._read_at: float | None = None
        self._value: float | None = None

    def some_avg10(self) -> float | None:
        """The ``some avg10`` percent (0-100), or None where the file is missing or unreadable
        (a kernel without PSI: the caller decides without it)."""
        now = self._clock()
        if self._read_at is None or now - self._read_at >= self.interval_s:
            self._read_at = now
            self._value = None
            try:
                with open(self.path) as f:
                    for line in f:
                        if line.startswith("some "):
                            fields = dict(kv.split("=", 1) for kv in line.split()[1:])
                            self._value = float(fields["avg10"])
                            break
            except (OSError, ValueError, KeyError):
                self._value = None
        return self._value


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
        pressure: the host's CPU pressure; above ``max_pressure`` percent, or without a
            reading (None, or a kernel without PSI), a step takes only the floor share,
            ``host_threads //`` the slots.
        max_pressure: that bound, percent.

    Raises:
        ValueError: ``slot`` outside the file, or ``host_threads`` < 1.
        OSError: the file cannot be opened or mapped.
    """

    def __init__(self, path: str | Path, slot: int, host_threads: int,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 pressure: CpuPressure | None = None,
                 max_pressure: float = MAX_PRESSURE) -> None:
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
        self.floor = max(1, host_threads // slots)  # the fixed split's share
        self._set_threads = set_threads
        self.pressure = pressure
        self.max_pressure = max_pressure
        self.threads = 0  # the count last applied (0: none yet)

    def busy_workers(self) -> int:
        """How many workers of the host have marked themselves busy (this one included once it
        did)."""
        return len(self._map) - self._map[:].count(0)

    def busy(self) -> int:
        """Mark this worker busy and apply its share for the coming step: ``host_threads //``
        the busy workers, at least 1; only the floor share while the host's CPU pressure is
        above ``max_pressure``. Returns the thread count."""
        self._map[self.slot] = 1
        threads = max(1, self.host_threads // self.busy_workers())
        if threads > self.floor and self.contended():
            threads = self.floor
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
        return threads

    def contended(self) -> bool:
        """Whether the host may be busy beyond this share's own workers: its CPU pressure
        above ``max_pressure``, or no reading (a kernel without PSI; True also without a
        ``pressure`` probe: the caller gave none to check)."""
        value = None if self.pressure is None else self.pressure.some_avg10()
        return value is None or value > self.max_pressure

    def idle(self) -> None:
        """Mark this worker idle (no step to run): the others may take its cores."""
        self._map[self.slot] = 0

    def close(self) -> None:
        """Mark idle and unmap the file."""
        if not self._map.closed:
            self.idle()
            self._map.close()
