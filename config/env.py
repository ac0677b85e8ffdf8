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
=============================== ================================================================

Process plumbing between the launcher and its children (not configuration) also lives here:
``SPLITSERVE_CPU_AFFINITY`` and ``SPLITSERVE_DIE_WITH_PARENT``.
"""

from __future__ import annotations

import os
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
