"""What the CPU can do fast, and the serving dtype that follows from it.

``auto`` serves in bfloat16 where ``/proc/cpuinfo`` lists AMX or AVX512-BF16 (oneDNN then runs
bf16 matrix products natively, about twice the float32 rate for half the memory traffic), or
AVX2 and FMA without AVX-512 with our C kernels built (they serve every bf16 product there), and
in float32 elsewhere (torch's bf16 without hardware support is emulated and slower than float32).
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from splitserve.config.schema import DTYPES

BF16_FLAGS = frozenset({"amx_bf16", "amx_tile", "avx512_bf16"})
AVX2_FLAGS = frozenset({"avx2", "fma"})  # gemv.c's AVX2 block (bfloat16 through our C kernels)
# oneDNN's packed bfloat16 linear (``mkldnn._reorder_linear_weight``) refuses CPUs without these
# ("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"), e.g.
# AVX2-only AMD Zen 3.
ONEDNN_BF16_PACK_FLAGS = (
    frozenset({"avx512bw", "avx512vl", "avx512dq"}),
    frozenset({"avx_ne_convert"}),
)


# The flags that decide which of our kernels run (and so every timing): printed with the CPU.
KERNEL_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``/proc/cpuinfo`` (empty where there is
    none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the end of the first processor
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@cache
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (empty where there is none)."""
    return frozenset(_cpuinfo_fields().get("flags", "").split())


def cpu_line() -> str:
    """The CPU for result lines and test logs, e.g. ``AMD EPYC family 25 model 1, 2 cores
    (avx2)``: its model name, family and model numbers (the name is often just "AMD EPYC" or
    "Intel Xeon Processor"; AMD 25/1 is Zen 3, 25/17 Zen 4, Intel 6/143 Sapphire Rapids), the
    cores this process may use, and which of ``KERNEL_FLAGS`` it has."""
    fields = _cpuinfo_fields()
    name = fields.get("model name") or "unknown CPU"
    family, model = fields.get("cpu family"), fields.get("model")
    if family and model:
        name += f" family {family} model {model}"
    flags = cpu_flags()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores ({', '.join(f for f in KERNEL_FLAGS if f in flags)})"


def onednn_packs_bf16() -> bool:
    """Whether oneDNN's packed bfloat16 linear runs on this CPU (see ``ONEDNN_BF16_PACK_FLAGS``);
    where it does not, bfloat16 products go through plain ``F.linear``."""
    flags = cpu_flags()
    return any(needed <= flags for needed in ONEDNN_BF16_PACK_FLAGS)


def resolve_dtype(name: str, device: str = "cpu", c_kernels: bool = False) -> tuple[str, str]:
    """``(dtype, why)`` for a ``--dtype`` value: ``auto`` picks by device and CPU flags, and on an
    AVX2 CPU by whether our C kernels serve (``c_kernels``: on and built). There bfloat16 runs
    through them at every step size (``gemv.c``'s AVX2 block: batch-1 decode 3.3x, 32 users 1.4x
    float32 served on a Zen 3, docs/performance.md); without them torch emulates bfloat16 and
    float32 is faster.

    Raises:
        ValueError: an unknown name.
    """
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {DTYPES}")
    if name != "auto":
        return name, "asked for"
    if device.startswith("cuda"):
        return "bfloat16", "auto: CUDA device"
    flags = cpu_flags()
    found = sorted(flags & BF16_FLAGS)
    if found:
        return "bfloat16", f"auto: CPU has {', '.join(found)}"
    # Measured on AVX2-only CPUs (every bf16 product ours there); AVX-512 CPUs without BF16
    # (oneDNN packs and emulates bf16) have not been measured: float32 as before.
    if AVX2_FLAGS <= flags and "avx512f" not in flags and c_kernels:
        return "bfloat16", "auto: CPU has avx2 and fma, and the C kernels serve bfloat16 there"
    return "float32", "auto: CPU lacks AMX/avx512_bf16 (and avx2 with the C kernels)"
