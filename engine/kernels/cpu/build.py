"""Build the CPU C kernels on first use and load them.

The sources (``csrc/*.c``) are plain C with no torch headers. Each is compiled to an object
file (in parallel, one compiler per core) and the objects linked into one shared library,
cached under ``$SPLITSERVE_CACHE/cpu_kernels/<hash of source, flags, compiler, CPU
features>/`` and rebuilt when any of those change. On a quiet machine the build takes seconds;
on a loaded 2-core one it took over two minutes, so each step gets :data:`STEP_TIMEOUT_S`.
OpenMP resolves to the ``libgomp.so.1`` torch has already loaded (same soname), so the kernels
share torch's thread pool and its ``torch.set_num_threads``.

The outcome is a :class:`KernelBuild`: the kernels, or why there are none: ``no compiler``
(callers keep their torch path, which is expected on such a machine) or ``build failed``
(logged at error level with the compiler's message: the engine still serves with torch ops,
but slower than it should, and the worker's start-up line and ``GET /workers``'
``kernel_plan`` say so). ``EngineConfig.cpu_kernels`` (``--disable-cpu-kernels``) makes the
engine never build them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from splitserve.config import env
from splitserve.engine.kernels.cpu.bindings import CpuKernels

log = logging.getLogger(__name__)

SOURCES = (
    "decode_attention.c",
    "decode_attention_q8.c",
    "extend_attention.c",
    "gemv.c",
    "gemm_bf16.c",
    "gemm_amx.c",
    "kv_append.c",
    "elementwise.c",
    "greedy.c",
    "decode_layers.c",
    "gemm_w8.c",
    "gemm_w4.c",
    "kv_quant.c",
    "lora.c",
)
HEADERS = ("bf16.h", "fast_exp.h", "kernels.h", "softmax.h", "x_quant.h")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared", "-fopenmp")
# One compile or the link, in seconds. The slowest file takes ~10 s on a quiet core; a
# machine whose cores are shared by several builds and test runs can be 20-50 times slower.
STEP_TIMEOUT_S = 900.0

BUILT, NO_COMPILER, FAILED = "built", "no compiler", "build failed"


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """The outcome of building the C kernels.

    Attributes:
        kernels: the loaded kernels, or None.
        state: :data:`BUILT`, :data:`NO_COMPILER` or :data:`FAILED`.
        detail: for a failure, the cause (the compiler's message, or the step that timed out);
            the compiler's path otherwise.
    """

    kernels: CpuKernels | None
    state: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.state == FAILED

    def describe(self) -> str:
        """One line for logs and ``/workers``: ``C kernels built (cc)``, ``C kernels: no C
        compiler, torch ops``, ``C kernels: BUILD FAILED (cause), torch ops``."""
        if self.state == BUILT:
            return f"C kernels built ({self.detail})"
        if self.state == NO_COMPILER:
            return "C kernels: no C compiler, torch ops"
        return f"C kernels: BUILD FAILED ({self.detail}), torch ops"


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


def _run(cmd: list[str], what: str, timeout_s: float) -> None:
    """Run one build step.

    Raises:
        RuntimeError: the step failed (with the compiler's message) or ran past ``timeout_s``.
    """
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"{what} timed out after {timeout_s:g} s (an overloaded machine?)"
        ) from None
    except subprocess.CalledProcessError as exc:
        message = (exc.stderr or exc.stdout or "").strip()[-2000:]
        raise RuntimeError(f"{what} failed (exit {exc.returncode}): {message}") from None
    except OSError as exc:
        raise RuntimeError(f"{what}: cannot run {cmd[0]}: {exc}") from None


def build_library(compiler: str, cache_dir: Path, timeout_s: float = STEP_TIMEOUT_S) -> Path:
    """Compile the sources into ``cache_dir`` (atomically: concurrent workers may race) and
    return the library's path; an existing build of the same hash is reused.

    Raises:
        RuntimeError: naming the source (or the link) that failed or timed out, and the cause.
    """
    src_dir = Path(__file__).parent / "csrc"
    digest = hashlib.sha256(" ".join((compiler, *FLAGS, *LINK_FLAGS)).encode() + _cpu_flags())
    for name in SOURCES + HEADERS:
        digest.update((src_dir / name).read_bytes())
    out_dir = cache_dir / digest.hexdigest()[:16]
    lib = out_dir / "libsplitserve_cpu.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        objects = [str(Path(tmp) / (Path(n).stem + ".o")) for n in SOURCES]
        steps = [
            ([compiler, *FLAGS, "-c", "-o", obj, str(src_dir / name)], f"compiling {name}")
            for name, obj in zip(SOURCES, objects, strict=True)
        ]
        with ThreadPoolExecutor(max_workers=min(len(steps), os.cpu_count() or 1)) as pool:
            for future in [pool.submit(_run, cmd, what, timeout_s) for cmd, what in steps]:
                future.result()  # the first failure, in source order
        staged = str(Path(tmp) / lib.name)
        _run([compiler, *LINK_FLAGS, "-o", staged, *objects], "linking", timeout_s)
        os.replace(staged, lib)
    return lib


def build_kernels(
    compiler: str | None,
    cache_dir: Path,
    timeout_s: float = STEP_TIMEOUT_S,
) -> KernelBuild:
    """Build (or reuse) and load the kernels with ``compiler`` (None: there is none).

    Never raises: a failure is returned as a :data:`FAILED` build, logged at error level."""
    if compiler is None:
        log.warning("no C compiler found (set CC or install cc): CPU kernels off, torch ops")
        return KernelBuild(None, NO_COMPILER)
    try:
        kernels = CpuKernels(ctypes.CDLL(str(build_library(compiler, cache_dir, timeout_s))))
    except (OSError, RuntimeError) as exc:
        build = KernelBuild(None, FAILED, f"{compiler}: {exc}")
        log.error(
            "the CPU C kernels failed to build; serving with torch ops, slower. %s", build.detail
        )
        return build
    return KernelBuild(kernels, BUILT, compiler)


def find_compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on ``PATH``, else None."""
    return env.optional_text(env.CC) or shutil.which("cc") or shutil.which("gcc")


@cache
def cpu_kernel_build() -> KernelBuild:
    """This process's build of the kernels (built on first call; the loaded library is the
    process's, like any shared object)."""
    return build_kernels(find_compiler(), _cache_dir())


def load_cpu_kernels() -> CpuKernels | None:
    """The C kernels, or None without a C compiler or when the build failed
    (:func:`cpu_kernel_build` says which)."""
    return cpu_kernel_build().kernels
