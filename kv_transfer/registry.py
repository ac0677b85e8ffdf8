"""KV transfer backends by name: the choices of ``--kv-transfer`` and the factories workers call.

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

from splitserve.config import KV_TRANSFER_BACKENDS
from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.ipc import Outbox
from splitserve.kv_transfer.base import BaseKVReceiver, BaseKVSender

__all__ = ["KV_TRANSFER_BACKENDS", "create_kv_pool", "create_kv_receiver", "create_kv_sender"]


def _check(name: str) -> None:
    if name not in KV_TRANSFER_BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}: expected one of {KV_TRANSFER_BACKENDS}")


def create_kv_pool(
    name: str, role: str, layout: KVLayout, num_pages: int, device: str = "cpu"
) -> KVPool:
    """The worker's KV pool, in memory the backend can reach (shm: a shared segment on the
    decode side).

    Raises:
        ValueError: unknown backend, or one that cannot use ``device``.
    """
    _check(name)
    if role == "decode" and name == "shm":
        if device != "cpu":
            raise ValueError(f"the shm KV transfer backend needs a CPU pool, not {device}")
        from splitserve.kv_transfer.shm_backend import create_shm_pool

        return create_shm_pool(layout, num_pages)
    return KVPool(layout, num_pages, device)


def create_kv_sender(name: str, pool: KVPool, outbox: Outbox) -> BaseKVSender:
    """The prefill worker's sender.

    Raises:
        ValueError: unknown backend, or its optional package is missing.
    """
    _check(name)
    if name == "shm":
        from splitserve.kv_transfer.shm_backend import ShmKVSender

        return ShmKVSender(pool, outbox)
    if name == "mooncake":
        from splitserve.kv_transfer.mooncake_backend import MooncakeKVSender

        return MooncakeKVSender(pool, outbox)
    if name == "nixl":
        from splitserve.kv_transfer.nixl_backend import NixlKVSender

        return NixlKVSender(pool, outbox)
    from splitserve.kv_transfer.zmq_backend import ZmqKVSender

    return ZmqKVSender(pool, outbox)


def create_kv_receiver(name: str, pool: KVPool) -> BaseKVReceiver:
    """The decode worker's receiver (``pool`` from :func:`create_kv_pool`).

    Raises:
        ValueError: unknown backend, or its optional package is missing.
    """
    _check(name)
    if name == "shm":
        from splitserve.kv_transfer.shm_backend import ShmKVReceiver

        return ShmKVReceiver(pool)
    if name == "mooncake":
        from splitserve.kv_transfer.mooncake_backend import MooncakeKVReceiver

        return MooncakeKVReceiver(pool)
    if name == "nixl":
        from splitserve.kv_transfer.nixl_backend import NixlKVReceiver

        return NixlKVReceiver(pool)
    from splitserve.kv_transfer.zmq_backend import ZmqKVReceiver

    return ZmqKVReceiver(pool)
