"""The worker-side half of ``serving_cpu.py``, loaded into each worker process by the
``sitecustomize`` that script puts on the cluster's ``PYTHONPATH`` (nothing in splitserve knows
of it): as ``splitserve.worker.build`` and ``splitserve.worker.outputs`` are imported, the model
step, the scheduler and the token outputs (built, then sent) are wrapped to sum their CPU
seconds into a small file the script reads (one per worker, ``<folder>/<pid>.probe``,
:data:`FIELDS` as doubles)."""

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
# Scheduler.schedule/update and in emitting token outputs (worker.outputs.decoded_outputs and
# OutboxPort.emit), and the number of model steps.
FIELDS = ("run_process", "run_thread", "sched_thread", "emit_thread", "steps")
FORMAT = struct.Struct(f"{len(FIELDS)}d")
HOOKED = ("splitserve.worker.outputs", "splitserve.worker.build")


def install(folder: str) -> None:
    """Wrap the worker's functions as soon as their modules (:data:`HOOKED`) are imported."""
    sys.meta_path.insert(0, _Hook(folder))


class _Hook:
    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.left = set(HOOKED)
        self.probe: _Probe | None = None  # made in a worker only (the first hooked import)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.left:
            return None
        self.left.discard(name)  # the find_spec below then passes this hook by
        if not self.left:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            if self.probe is None:
                self.probe = _Probe(self.folder)
            self.probe.wrap(module)

        spec.loader.exec_module = exec_module
        return spec


class _Probe:
    """The accumulators of one worker process, in its probe file."""

    def __init__(self, folder: str) -> None:
        path = os.path.join(folder, f"{os.getpid()}.probe")
        with open(path, "wb") as f:
            f.write(bytes(FORMAT.size))
        with open(path, "r+b") as f:
            self.buf = mmap.mmap(f.fileno(), FORMAT.size)
        self.acc = [0.0] * len(FIELDS)

    def timed_run(self, fn: Callable) -> Callable:
        acc, buf = self.acc, self.buf
        process_time, thread_time = time.process_time, time.thread_time

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

    def timed(self, fn: Callable, slot: int) -> Callable:
        acc, buf, thread_time = self.acc, self.buf, time.thread_time

        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[slot] += thread_time() - t0
                FORMAT.pack_into(buf, 0, *acc)

        return call

    def wrap(self, module: ModuleType) -> None:
        """Wrap what ``module`` (one of :data:`HOOKED`) holds, before anything imports it."""
        if module.__name__ == "splitserve.worker.outputs":
            module.decoded_outputs = self.timed(module.decoded_outputs, 3)
            return
        module.ModelRunner.run = self.timed_run(module.ModelRunner.run)
        module.Scheduler.schedule = self.timed(module.Scheduler.schedule, 2)
        module.Scheduler.update = self.timed(module.Scheduler.update, 2)
        module.OutboxPort.emit = self.timed(module.OutboxPort.emit, 3)
