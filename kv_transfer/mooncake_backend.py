"""KV transfer over Mooncake Transfer Engine (optional extra: ``pip install splitserve[mooncake]``).

Both workers start a ``TransferEngine`` (TCP protocol, peer-to-peer handshake: no metadata
server) and register their KV pool's memory. The decode worker's bootstrap ``endpoint`` names its
engine session (``host:rpc_port``) and the pool's base address; the prefill worker writes each run
of pages one-sidedly at ``base + page_id * page_bytes``, then sends the ``KVPages`` header over
ZeroMQ. Where RDMA devices exist the same engine would use them (protocol ``rdma``).

Writes run on one background thread (``kv_transfer.one_sided``: the engine's blocking
``batch_transfer_sync_write`` releases the GIL), headers follow in order, and a request that
fails mid-transfer is fenced until this worker acknowledges that its writes ended.

Speed: Mooncake's TCP transport moves each write request over one pooled connection in 64 KiB
``asio`` reads and writes on a single event-loop thread per process (a compiled-in buffer size);
on this 2-core machine it reached about 0.5-0.6x of the zmq backend, and splitting a transfer
into several requests (several connections) did not change that (docs/performance.md, "KV transfer").
"""

from __future__ import annotations

import time

from splitserve.engine.kv_pool import KVPool
from splitserve.ipc.frames import Frames, as_frames
from splitserve.ipc.messages import KVBootstrap, KVPages
from splitserve.ipc.sockets import Outbox
from splitserve.kv_transfer.base import BaseKVReceiver, KVTransferBackend
from splitserve.kv_transfer.one_sided import BaseOneSidedSender

PROTOCOL = "tcp"


def _start_engine(host: str, pool: KVPool):
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ValueError(
            "KV transfer backend 'mooncake' needs Mooncake Transfer Engine: "
            f"pip install 'splitserve[mooncake]' ({exc})"
        ) from exc
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", PROTOCOL, "") != 0:
        raise ValueError(f"Mooncake Transfer Engine failed to start on {host} ({PROTOCOL})")
    buf = pool.buffer
    if engine.register_memory(buf.data_ptr(), buf.numel() * buf.element_size()) != 0:
        raise ValueError("Mooncake Transfer Engine could not register the KV pool")
    return engine


class MooncakeKVSender(BaseOneSidedSender):
    """One-sided writes into the decode pool, on a background thread (``kv_transfer.one_sided``).

    Raises (constructor):
        ValueError: Mooncake is not installed, its engine does not start, or the pool cannot be
            registered.
    """

    name = "mooncake"

    def __init__(self, pool: KVPool, outbox: Outbox, host: str = "127.0.0.1") -> None:
        self.engine = _start_engine(host, pool)
        super().__init__(pool, outbox)

    def _peer(self, boot: KVBootstrap) -> str:
        return boot.endpoint["session"]

    def _write(self, peer: object, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        ret = self.engine.batch_transfer_sync_write(peer, srcs, dsts, lens)
        if ret != 0:
            raise RuntimeError(f"to {peer}: code {ret}")


class MooncakeKVReceiver(BaseKVReceiver):
    """Registers the pool; pages are written by the peer before the header arrives."""

    name = "mooncake"
    one_sided = True

    def __init__(self, pool: KVPool, host: str = "127.0.0.1") -> None:
        super().__init__(pool)
        self.host = host
        self.engine = _start_engine(host, pool)

    def endpoint(self) -> dict[str, str]:
        return {
            "session": f"{self.host}:{self.engine.get_rpc_port()}",
            "base_ptr": str(self.pool.buffer.data_ptr()),
            "num_pages": str(self.pool.allocator.num_pages),
        }

    def install(self, header: KVPages, frames: Frames | list) -> None:
        if header.num_frames or as_frames(frames).more:
            raise ValueError(f"KV message for {header.rid}: mooncake transfer carries no frames")
        latency = time.time() - header.sent_at if header.sent_at else None
        num_bytes = len(header.page_ids) * self.pool.layout.page_bytes
        self.metrics.record_install(num_bytes, len(header.page_ids), latency)


BACKEND = KVTransferBackend("mooncake", MooncakeKVSender, MooncakeKVReceiver)
