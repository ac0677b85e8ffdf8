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
VNNI_KERNEL_FLAGS = ("avx512_vnni", "avx512bw")  # gemm_w4.c; gemm_w8.c on AVX-512
AVX2_KERNEL_FLAGS = ("avx2", "fma")  # gemm_w8.c's AVX2 path, where the CPU has no AVX-512
AMX_KERNEL_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16")  # gemm_amx.c
# oneDNN's packed bfloat16 linear (``layers.can_pack``): either set (not on AVX2-only CPUs).
ONEDNN_PACK_FLAG_SETS = (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",))


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


def w8_kernel_flags() -> tuple[str, ...]:
    """The CPU flags ``gemm_w8.c`` (int8 weight products) needs on this machine: AVX512-VNNI
    and BW where the CPU has AVX-512 (its AVX2 path is built only without it), else AVX2 and
    FMA."""
    return VNNI_KERNEL_FLAGS if "avx512f" in cpu_flags() else AVX2_KERNEL_FLAGS


def onednn_packs_bf16() -> bool:
    """Whether this CPU's flags (read here) let oneDNN pack bfloat16 weights; where they do,
    ``layers.can_pack`` must say so too (the tests that use this assert it)."""
    flags = cpu_flags()
    return any(all(f in flags for f in needed) for needed in ONEDNN_PACK_FLAG_SETS)


def require_onednn_pack() -> pytest.MarkDecorator:
    """A mark for tests of oneDNN's packed bfloat16 copies: skip only where the CPU lacks the
    flags (:data:`ONEDNN_PACK_FLAG_SETS`, e.g. AVX2-only AMD Zen 3); where it has them,
    ``layers.can_pack`` must agree, else the module fails at collection.

    Raises:
        pytest.fail.Exception: the CPU has the flags but ``can_pack`` says no.
    """
    import torch

    from splitserve.engine.model.layers import can_pack

    if not onednn_packs_bf16():
        return pytest.mark.skip(reason="this CPU lacks AVX-512 BW/VL/DQ and AVX-NE-CONVERT "
                                "(oneDNN packs no bfloat16 weight)")
    if not can_pack(torch.empty(1, 1, dtype=torch.bfloat16)):
        pytest.fail("the CPU's flags allow oneDNN's bfloat16 packing but can_pack says no",
                    pytrace=False)
    return pytest.mark.skipif(False, reason="")


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
