"""KV transfer backends by name: the factories workers call. The names (``--kv-transfer``)
are ``splitserve.config.registry.KV_TRANSFER``:

=========  ==================================================================================
zmq        default; pages as raw ZeroMQ frames (tcp:// or ipc://), zero-copy from the pool
shm        same host; the decode pool is a shared-memory segment the prefill worker writes into
mooncake   Mooncake Transfer Engine (TCP here, RDMA where present): one-sided writes into the
           decode worker's registered pool; optional extra ``splitserve[mooncake]``
nixl       NIXL with its UCX backend (cma on one host, TCP or RDMA between hosts): one-sided
           writes into the decode worker's registered pool; optional extra ``splitserve[nixl]``
=========  ==================================================================================
"""

from __future__ import annotations

from splitserve.config.registry import KV_TRANSFER
from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.ipc.sockets import Outbox
from splitserve.kv_transfer.base import BaseKVReceiver, BaseKVSender, KVTransferBackend

__all__ = ["create_kv_pool", "create_kv_receiver", "create_kv_sender", "load_backend"]


def load_backend(name: str) -> KVTransferBackend:
    """The backend registered as ``name``.

    Raises:
        ValueError: unknown backend.
    """
    return KV_TRANSFER.load(name)


def create_kv_pool(
    name: str, layout: KVLayout, num_pages: int, device: str = "cpu", receives_kv: bool = False
) -> KVPool:
    """A worker's KV pool, in memory the backend can reach: on a worker that ``receives_kv``
    (decode), the backend's receiving pool where it has one (shm: a shared segment).

    Raises:
        ValueError: unknown backend, or one that cannot use ``device``.
    """
    backend = load_backend(name)
    if receives_kv and backend.receiving_pool is not None:
        return backend.receiving_pool(layout, num_pages, device)
    return KVPool(layout, num_pages, device)


def create_kv_sender(name: str, pool: KVPool, outbox: Outbox) -> BaseKVSender:
    """The prefill worker's sender.

    Raises:
        ValueError: unknown backend, or its optional package is missing.
    """
    return load_backend(name).sender(pool, outbox)


def create_kv_receiver(name: str, pool: KVPool) -> BaseKVReceiver:
    """The decode worker's receiver (``pool`` from :func:`create_kv_pool`).

    Raises:
        ValueError: unknown backend, or its optional package is missing.
    """
    return load_backend(name).receiver(pool)
