"""The KV transfer interface: how a prefill worker ships a request's pages to a decode worker.

The control flow (DESIGN.md, "KV transfer") is the same for every backend: the decode worker
reserves pages and sends a ``KVBootstrap`` naming them; the prefill worker computes the prompt and
calls :meth:`BaseKVSender.send`; the decode worker calls :meth:`BaseKVReceiver.install` for each
``KVPages`` message. Backends differ only in how the page bytes move.
"""

from __future__ import annotations

import abc

from splitserve.engine.kv_pool import KVLayout
from splitserve.messages import KVLayoutMsg, KVPages


def layout_to_msg(layout: KVLayout) -> KVLayoutMsg:
    return KVLayoutMsg(
        layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size, layout.dtype
    )


def layout_from_msg(msg: KVLayoutMsg) -> KVLayout:
    return KVLayout(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.page_size, msg.dtype)


class BaseKVSender(abc.ABC):
    """Prefill side."""

    @abc.abstractmethod
    def send(
        self,
        dst_addr: str,
        rid: str,
        src_page_ids: list[int],
        dst_page_ids: list[int],
        first_token: int,
        first_logprob: float,
        finished: bool,
    ) -> None:
        """Ship pages ``src_page_ids`` (of this worker's pool) into ``dst_page_ids`` of the peer
        at ``dst_addr``, then the first sampled token. The source pages may be freed as soon as
        this returns.

        Raises:
            splitserve.ipc.PeerUnreachable: the peer does not accept data.
        """


class BaseKVReceiver(abc.ABC):
    """Decode side."""

    @abc.abstractmethod
    def install(self, header: KVPages, frames: list) -> None:
        """Write the pages carried by one ``KVPages`` message into the local pool.

        Raises:
            ValueError: the frames do not match the header or the pool's layout.
        """
