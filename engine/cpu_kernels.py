"""Small C kernels for the CPU decode step, compiled on first use and called through ctypes.

The sources (``engine/csrc/*.c``) are plain C with no torch headers, so one ``cc -O3
-march=native -fopenmp -shared`` takes about half a second; the library is cached under
``~/.cache/splitserve/cpu_kernels/<hash of source, flags, compiler>/`` and rebuilt when any of
those change. OpenMP resolves to the ``libgomp.so.1`` torch has already loaded (same soname), so
the kernels share torch's thread pool and its ``torch.set_num_threads``.

Without a C compiler, on a build failure, or with ``SPLITSERVE_CPU_KERNELS=0``,
:func:`load_cpu_kernels` returns None and callers keep their torch path.
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

import torch

log = logging.getLogger(__name__)

CPU_KERNELS_ENV = "SPLITSERVE_CPU_KERNELS"  # "0": never build or use the C kernels
SOURCES = ("decode_attention.c",)
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


def _cache_dir() -> Path:
    root = os.environ.get("SPLITSERVE_CACHE_DIR") or Path.home() / ".cache" / "splitserve"
    return Path(root) / "cpu_kernels"


def _build(compiler: str) -> Path:
    """Compile the sources into the cache (atomically: concurrent workers may race)."""
    src_dir = Path(__file__).parent / "csrc"
    digest = hashlib.sha256(" ".join((compiler, *FLAGS)).encode())
    for name in SOURCES:
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


class CpuKernels:
    """The loaded library. Every method takes contiguous CPU tensors and checks nothing that
    its docstring does not say: callers own the shapes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._attn = lib.decode_attention_bf16
        self._attn.restype = ctypes.c_int
        self._attn.argtypes = [_ptr, _i64] + [_ptr] * 4 + [_i64] * 6 + [_f32, _ptr]

    def decode_attention(
        self,
        q: torch.Tensor,
        kt: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
        window: int | None,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """One query token per row against its slot's cached keys, in one pass per head.

        Args:
            q: ``[R, Hq, D]`` bfloat16; each row's heads contiguous (rows may be strided, as
                slices of a fused q/k/v projection are).
            kt: ``[num_slots, Hkv, D, cap]`` bfloat16 keys (transposed), contiguous.
            v: ``[num_slots, Hkv, cap, D]`` bfloat16 values, contiguous.
            slots: ``[R]`` int64 slot of each row.
            lens: ``[R]`` int64: row ``r`` attends to key positions ``0 .. lens[r] - 1`` (the
                last ``window`` of them with a sliding window); 0 leaves its output untouched.
            window: sliding window, or None.
            scale: softmax scale.
            out: ``[R, Hq, D]`` bfloat16, contiguous; written and returned.

        Scores, softmax and the value sum run in float32 (no intermediate bfloat16 rounding);
        the output is rounded to nearest even. Shapes the kernel takes: see :meth:`supports`.

        Raises:
            MemoryError: the kernel could not allocate its score buffers.
        """
        r, hq, d = q.shape
        hkv, cap = kt.shape[1], kt.shape[3]
        rc = self._attn(
            q.data_ptr(), q.stride(0), kt.data_ptr(), v.data_ptr(), slots.data_ptr(),
            lens.data_ptr(), r, hkv, hq // hkv, d, cap, window or 0, scale, out.data_ptr(),
        )
        if rc == -1:
            raise MemoryError("decode attention kernel: out of memory")
        if rc != 0:
            raise ValueError(f"decode attention kernel: unsupported shape q {tuple(q.shape)}")
        return out

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether :meth:`decode_attention` takes these heads: at most 8 query heads per KV
        head and ``head_dim`` a multiple of 16 up to 256."""
        g = num_heads // num_kv_heads
        return 1 <= g <= 8 and head_dim % 16 == 0 and head_dim <= 256


@cache
def load_cpu_kernels() -> CpuKernels | None:
    """The C kernels, built on first call; None when disabled, without a C compiler, or when the
    build fails (logged once)."""
    if os.environ.get(CPU_KERNELS_ENV, "1") == "0":
        return None
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
