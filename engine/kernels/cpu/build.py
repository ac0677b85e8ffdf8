"""Build the CPU C kernels on first use and load them.

The sources (``csrc/*.c``) are plain C with no torch headers, so one ``cc -O3 -march=native
-fopenmp -shared`` takes a few seconds; the library is cached under
``$SPLITSERVE_CACHE/cpu_kernels/<hash of source, flags, compiler, CPU features>/`` and rebuilt
when any of those change. OpenMP resolves to the ``libgomp.so.1`` torch has already loaded (same
soname), so the kernels share torch's thread pool and its ``torch.set_num_threads``.

Without a C compiler or on a build failure :func:`load_cpu_kernels` returns None and callers
keep their torch path; ``EngineConfig.cpu_kernels`` (``--disable-cpu-kernels``) makes the engine
never call it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from splitserve.config import env
from splitserve.engine.kernels.cpu.bindings import CpuKernels

log = logging.getLogger(__name__)

SOURCES = (
    "decode_attention.c", "extend_attention.c", "gemv.c", "gemm_bf16.c", "kv_append.c",
    "elementwise.c", "greedy.c", "decode_layers.c", "gemm_w8.c",
    "gemm_w4.c", "kv_quant.c",
)
HEADERS = ("bf16.h", "fast_exp.h", "kernels.h")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")


def _cache_dir() -> Path:
    """``$SPLITSERVE_CACHE/cpu_kernels`` (the default model's cache, ``~/.cache/splitserve``)."""
    return env.cache_dir() / "cpu_kernels"


def _cpu_flags() -> bytes:
    """This CPU's feature flags: ``-march=native`` code is only valid where they match (a
    cache on a home directory shared by several machines)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _build(compiler: str) -> Path:
    """Compile the sources into the cache (atomically: concurrent workers may race)."""
    src_dir = Path(__file__).parent / "csrc"
    digest = hashlib.sha256(" ".join((compiler, *FLAGS)).encode() + _cpu_flags())
    for name in SOURCES + HEADERS:
        digest.update((src_dir / name).read_bytes())
    out_dir = _cache_dir() / digest.hexdigest()[:16]
    lib = out_dir / "libsplitserve_cpu.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [compiler, *FLAGS, "-o", tmp, *(str(src_dir / n) for n in SOURCES)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@cache
def load_cpu_kernels() -> CpuKernels | None:
    """The C kernels, built on first call (the loaded library is the process's, like any shared
    object); None without a C compiler or when the build fails (logged once)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode kernels off, torch ops instead")
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU decode kernels failed to build (%s): torch ops instead", detail)
        return None
