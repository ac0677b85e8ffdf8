"""Configs for tests that launch clusters or build workers in-process.

Tests name the fields they care about flatly (``kv_cache_mb=64, num_decode=2``); each name goes
to the section of :class:`~splitserve.config.ServeConfig` that has it, so a typo or a field that
moved fails loudly. The engine runs float32 unless a test asks otherwise: the
equality tests compare against ``transformers`` in float32, whatever the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from splitserve.config import EngineConfig, ServeConfig, WorkerConfig
from splitserve.ipc.sockets import free_tcp_addr


def free_port() -> int:
    """A free port below the ephemeral range, as the launcher's worker ports (``free_tcp_addr``)."""
    return int(free_tcp_addr().rsplit(":", 1)[1])


def engine_config(model_path: str | Path, **fields: Any) -> EngineConfig:
    return EngineConfig(**{"model": str(model_path), "dtype": "float32", **fields})


def serve_config(model_path: str | Path, **fields: Any) -> ServeConfig:
    """A cluster on a free port, float32 unless ``dtype`` is given (``ServeConfig.from_fields``)."""
    fields = {"model": str(model_path), "dtype": "float32", "port": free_port(), **fields}
    return ServeConfig.from_fields(**fields)


def worker_config(model_path: str | Path, role: str, server_addr: str, num_threads: int = 1,
                  **engine: Any) -> WorkerConfig:
    """One worker on a free loopback inbox, reporting to ``server_addr``."""
    return WorkerConfig(role=role, worker_id=f"{role}-t", addr=free_tcp_addr(),
                        server_addr=server_addr, num_threads=num_threads,
                        engine=engine_config(model_path, **engine))


def replace(config: msgspec.Struct, **fields: Any) -> msgspec.Struct:
    return msgspec.structs.replace(config, **fields)
