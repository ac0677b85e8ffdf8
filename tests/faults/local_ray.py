"""A local Ray instance owned by one test (skipped without Ray: ``pip install 'splitserve[ray]'``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def local_ray(num_cpus: int) -> Iterator[Any]:
    """``ray.init`` with ``num_cpus`` CPUs, no dashboard; yields the ``ray`` module.
    ``ray.shutdown()`` after stops exactly what it started."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'ray>=2.9'")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
