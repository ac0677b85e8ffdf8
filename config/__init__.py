"""The one typed configuration (``schema``), the registry of pluggable parts (``registry``), the
CLI flags generated from both (``flags``), and the environment, read in one place (``env``)."""

from splitserve.config.schema import (
    ClusterConfig,
    EngineConfig,
    SecurityConfig,
    ServeConfig,
    ServerConfig,
    TracingConfig,
    WorkerConfig,
)

__all__ = [
    "ClusterConfig",
    "EngineConfig",
    "SecurityConfig",
    "ServeConfig",
    "ServerConfig",
    "TracingConfig",
    "WorkerConfig",
]
