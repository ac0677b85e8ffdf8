"""The C kernels for the tests that exercise them: their tests skip only where there is no C
compiler; a build that failed (or timed out) fails them instead, so a broken build is never
reported as a skip."""

from __future__ import annotations

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
