"""The worker-side half of ``serving_cpu.py``, loaded into each worker process by the
``sitecustomize`` that script puts on the cluster's ``PYTHONPATH`` (nothing in splitserve knows
of it): once ``splitserve.worker.base`` is imported, its model step, scheduler and output
sending are wrapped to sum their CPU seconds into a small file the script reads (one per worker,
``<folder>/<pid>.probe``, :data:`FIELDS` as doubles)."""

from __future__ import annotations

import importlib.util
import mmap
import os
import struct
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

# CPU seconds inside ModelRunner.run (whole process, then main thread), main-thread seconds in
# Scheduler.schedule/update and in BaseWorker.emit_decoded, and the number of model steps.
FIELDS = ("run_process", "run_thread", "sched_thread", "emit_thread", "steps")
FORMAT = struct.Struct(f"{len(FIELDS)}d")


def install(folder: str) -> None:
    """Wrap the worker's methods as soon as ``splitserve.worker.base`` is imported."""
    sys.meta_path.insert(0, _Hook(folder))


class _Hook:
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "splitserve.worker.base":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _wrap(module, self.folder)

        spec.loader.exec_module = exec_module
        return spec


def _wrap(base: ModuleType, folder: str) -> None:
    path = os.path.join(folder, f"{os.getpid()}.probe")
    with open(path, "wb") as f:
        f.write(bytes(FORMAT.size))
    with open(path, "r+b") as f:
        buf = mmap.mmap(f.fileno(), FORMAT.size)
    acc = [0.0] * len(FIELDS)
    process_time, thread_time = time.process_time, time.thread_time

    def timed_run(fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            p0, t0 = process_time(), thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[0] += process_time() - p0
                acc[1] += thread_time() - t0
                acc[4] += 1
                FORMAT.pack_into(buf, 0, *acc)

        return run

    def timed(fn: Callable, slot: int) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[slot] += thread_time() - t0
                FORMAT.pack_into(buf, 0, *acc)

        return call

    base.ModelRunner.run = timed_run(base.ModelRunner.run)
    base.Scheduler.schedule = timed(base.Scheduler.schedule, 2)
    base.Scheduler.update = timed(base.Scheduler.update, 2)
    base.BaseWorker.emit_decoded = timed(base.BaseWorker.emit_decoded, 3)
