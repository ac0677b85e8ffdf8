"""The C kernels for the tests that exercise them: their tests skip only where there is no C
compiler; a build that failed (or timed out) fails them instead, so a broken build is never
reported as a skip. A kernel that needs CPU features skips only where ``/proc/cpuinfo`` lacks
them (:func:`require_kernel`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.engine.kernels.cpu.bindings import CpuKernels
from splitserve.engine.kernels.cpu.build import cpu_kernel_build


def load_or_fail() -> CpuKernels | None:
    """The process's C kernels, or None without a C compiler.

    Raises:
        pytest.fail.Exception: the build failed; at a module's top level this is a collection
            error naming the cause.
    """
    build = cpu_kernel_build()
    if build.failed:
        pytest.fail(build.describe(), pytrace=False)
    return build.kernels


# The CPU flags each C kernel is compiled for (``-march=native``; the ``#if`` of its source).
BF16_KERNEL_FLAGS = ("avx512_bf16",)  # gemm_bf16.c, extend_attention.c, decode_attention.c
VNNI_KERNEL_FLAGS = ("avx512_vnni", "avx512bw")  # gemm_w8.c, gemm_w4.c
AMX_KERNEL_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16")  # gemm_amx.c


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The flags of this machine's first CPU, read from ``/proc/cpuinfo`` by the test itself
    (not through the kernels' own probe, which is what is under test). Empty where the file
    is missing (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def require_kernel(kernels: CpuKernels | None, available: bool, flags: tuple[str, ...],
                   what: str) -> pytest.MarkDecorator:
    """A mark for tests of one C kernel: skip only without a C compiler (``kernels`` None) or
    where ``/proc/cpuinfo`` lacks one of ``flags``. Where the CPU has them, the kernel must
    have been built (``available``): a kernel that should build on this CPU but did not fails
    the module at collection, naming the flags, instead of skipping.

    Raises:
        pytest.fail.Exception: the CPU has ``flags`` but ``available`` is False.
    """
    if kernels is None:
        return pytest.mark.skip(reason="no C compiler")
    missing = [f for f in flags if f not in cpu_flags()]
    if missing:
        return pytest.mark.skip(reason=f"this CPU lacks {', '.join(missing)} ({what})")
    if not available:
        pytest.fail(f"{what}: this CPU has {', '.join(flags)} (/proc/cpuinfo) but the C build "
                    "does not provide the kernel", pytrace=False)
    return pytest.mark.skipif(False, reason="")


def check_kernel(kernels: CpuKernels | None, available: bool, flags: tuple[str, ...],
                 what: str) -> None:
    """Inside a test, :func:`require_kernel`'s rule: skip without a compiler or the CPU flags,
    fail when the CPU has them and the kernel is missing.

    Raises:
        pytest.skip.Exception, pytest.fail.Exception: as above.
    """
    if kernels is None:
        pytest.skip("no C compiler")
    missing = [f for f in flags if f not in cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} ({what})")
    assert available, (f"{what}: this CPU has {', '.join(flags)} (/proc/cpuinfo) but the C "
                       "build does not provide the kernel")
