"""Every environment variable splitserve reads, read here and nowhere else.

An environment variable only ever supplies a *default* of a config field (a flag or an explicit
field value wins), or a path of the installation (the cache folder). Nothing deep in the engine
looks at the environment: it gets its switches from :class:`splitserve.config.EngineConfig`.

=============================== ================================================================
``SPLITSERVE_DEVICE``           ``engine.device`` default (``cpu`` | ``cuda``)
``SPLITSERVE_ATTENTION``        ``engine.attention`` default (``auto`` | ``torch`` | ``triton``)
``SPLITSERVE_CPU_KERNELS``      ``engine.cpu_kernels`` default (``0`` turns the C kernels off)
``SPLITSERVE_PACK_WEIGHTS``     ``engine.pack_weights`` default (``0``: plain ``F.linear``)
``SPLITSERVE_FUSED_DECODE``     ``engine.fused_decode`` default (``0``: per-op decode layers)
``SPLITSERVE_DECODE_KV_CACHE``  ``engine.decode_kv_cache`` default (``0``: gather from the pool)
``SPLITSERVE_KERNELS``          ``engine.kernels`` default (``auto`` | ``c`` | ``torch`` | a file)
``SPLITSERVE_API_KEY``          ``security.api_key`` default (keeps the key out of ``ps``)
``SPLITSERVE_CACHE``            the cache folder (default ``~/.cache/splitserve``): converted
                                models, compiled C kernels
``CC``                           the C compiler that builds the CPU kernels (default: ``cc``,
                                else ``gcc``, on ``PATH``)
``TRITON_INTERPRET``            Triton's own (``1``: its kernels run in its CPU interpreter,
                                decided when a kernel is decorated); read here so the Triton
                                attention backend does float32 arithmetic, which the interpreter
                                needs
=============================== ================================================================

Process plumbing between the launcher and its children (not configuration) also lives here:
``SPLITSERVE_CPU_AFFINITY``, ``SPLITSERVE_DIE_WITH_PARENT`` and a child's whole environment
(:func:`child_environ`); and what is given to a library's own variable before it loads: a
default (``UCX_MODULES`` for NIXL's UCX, :func:`set_default`) or a value (Ray's
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, :func:`set_value`).

Elsewhere the package never reads the environment (``tests/test_environment_reads.py``): it may
only hand the whole of it to a child process as the base of the child's environment, and set a
variable (``os.environ[NAME] = value``) for a library or a child to read; the package does both
through the functions here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEVICE = "SPLITSERVE_DEVICE"
ATTENTION = "SPLITSERVE_ATTENTION"
CPU_KERNELS = "SPLITSERVE_CPU_KERNELS"
PACK_WEIGHTS = "SPLITSERVE_PACK_WEIGHTS"
FUSED_DECODE = "SPLITSERVE_FUSED_DECODE"
DECODE_KV_CACHE = "SPLITSERVE_DECODE_KV_CACHE"
KERNELS = "SPLITSERVE_KERNELS"
API_KEY = "SPLITSERVE_API_KEY"
CACHE = "SPLITSERVE_CACHE"
CPU_AFFINITY = "SPLITSERVE_CPU_AFFINITY"  # "0,1": CPUs a child pins itself to at start-up
DIE_WITH_PARENT = "SPLITSERVE_DIE_WITH_PARENT"  # "1": a child exits when its launcher dies
CC = "CC"  # the C compiler (engine.kernels.cpu.build)
TRITON_INTERPRET = "TRITON_INTERPRET"  # Triton's CPU interpreter (engine.attention.triton)
UCX_MODULES = "UCX_MODULES"  # UCX's modules to load (NIXL's transport, kv_transfer.nixl_backend)
# Ray's switch for clusters on one machine's loopback (it is named for Windows and macOS,
# where Ray keeps to loopback by default). Off, Ray never rewrites 127.0.0.1 to the machine's
# other address, where a GCS bound to loopback does not listen (launch.ray_host).
RAY_CLUSTER = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def text(name: str, default: str) -> str:
    """``$name``, or ``default`` when unset or empty."""
    return os.environ.get(name) or default


def optional_text(name: str) -> str | None:
    return os.environ.get(name) or None


def switch(name: str, default: bool = True) -> bool:
    """An on/off variable: ``0`` (or ``false``/``off``/``no``) is off, anything else on."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    """``$SPLITSERVE_CACHE``, default ``~/.cache/splitserve``."""
    return Path(os.environ.get(CACHE) or Path.home() / ".cache" / "splitserve")


def cpu_affinity() -> list[int] | None:
    """The CPUs ``$SPLITSERVE_CPU_AFFINITY`` names (set by the launcher per child), or None."""
    value = os.environ.get(CPU_AFFINITY)
    return [int(c) for c in value.split(",")] if value else None


def die_with_parent() -> bool:
    return os.environ.get(DIE_WITH_PARENT) == "1"


def triton_interpret() -> bool:
    """True when ``$TRITON_INTERPRET`` is ``1``: Triton runs its kernels in its CPU interpreter
    (Triton reads the variable itself; this says what it decided)."""
    return os.environ.get(TRITON_INTERPRET) == "1"


def set_default(name: str, value: str) -> None:
    """Set ``$name`` to ``value`` unless it is set already: the default of a variable that a
    library reads itself, given before the library loads (a value the user set wins)."""
    os.environ.setdefault(name, value)


def set_value(name: str, value: str) -> None:
    """Set ``$name`` to ``value``, over what the user set: a variable that a library reads
    itself, and that this process's children inherit."""
    os.environ[name] = value


def child_environ(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of a child process: a copy of this process's whole environment with
    ``extra`` laid over it (what the launcher adds comes from the config, never read here)."""
    return {**os.environ, **extra}
