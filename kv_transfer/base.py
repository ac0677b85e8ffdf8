"""The KV transfer interface: how a prefill worker ships a request's pages to a decode worker.

The control flow (docs/design.md, "KV transfer") is the same for every backend: the decode worker
reserves pages and sends a ``KVBootstrap`` naming them (and, in ``endpoint``, whatever the backend
needs to reach its pool: a shared-memory segment, a registered memory address); the prefill
worker calls :meth:`BaseKVSender.send` once per computed chunk of the prompt (``last=False``) and
once more with the first token (``last=True``); the decode worker calls
:meth:`BaseKVReceiver.install` for each ``KVPages`` message. Backends differ only in how the page
bytes move: as ZeroMQ frames after the header, or written straight into the decode pool before
the header is sent.

Backends are chosen by name (``--kv-transfer``): each backend module defines a
:class:`KVTransferBackend` named ``BACKEND``, registered in ``splitserve.config.registry``;
``kv_transfer.registry`` builds its parts.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.ipc.frames import Frames
from splitserve.ipc.messages import KVBootstrap, KVLayoutMsg, KVPages, WeightsMsg
from splitserve.ipc.sockets import Outbox
from splitserve.kv_transfer.metrics import TransferMetrics


def layout_to_msg(layout: KVLayout) -> KVLayoutMsg:
    return KVLayoutMsg(
        layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size, layout.dtype,
        layout.kv_cache_dtype,
    )


def layout_from_msg(msg: KVLayoutMsg) -> KVLayout:
    return KVLayout(
        msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.page_size, msg.dtype,
        msg.kv_cache_dtype,
    )


def weights_mismatch(here: WeightsMsg, peer: WeightsMsg | None) -> str | None:
    """A message naming every field of the weights identity that differs between this worker
    (``here``) and the decode worker (``peer``), or None when they agree.

    KV computed by one model (or one weight quantization) is wrong for another, and the
    decode side would continue from it silently; so a missing identity is a mismatch too.
    """
    if peer is None:
        return "weights mismatch (the decode worker's bootstrap does not name its weights)"
    diffs = [
        f"{name}: {getattr(here, name) or '(not sent)'} here vs "
        f"{getattr(peer, name) or '(not sent)'} on the decode worker"
        for name in WeightsMsg.__struct_fields__
        if getattr(here, name) != getattr(peer, name)
    ]
    return "weights mismatch (" + "; ".join(diffs) + ")" if diffs else None


def contiguous_runs(page_ids: list[int]) -> list[tuple[int, int]]:
    """``(index into page_ids, length)`` of each maximal run of consecutive page ids."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(page_ids) + 1):
        if i == len(page_ids) or page_ids[i] != page_ids[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    return runs if page_ids else []


def joint_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src start page, dst start page, length)`` runs contiguous on both sides."""
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        runs.append((src[i], dst[i], j - i))
        i = j
    return runs


class BaseKVSender(abc.ABC):
    """Prefill side. ``metrics`` counts what was sent."""

    name = "base"

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.metrics = TransferMetrics(self.name)

    @abc.abstractmethod
    def send(
        self,
        boot: KVBootstrap,
        src_page_ids: list[int],
        dst_page_ids: list[int],
        *,
        last: bool,
        first_token: int = -1,
        first_logprob: float = 0.0,
        finished: bool = False,
    ) -> None:
        """Ship pages ``src_page_ids`` of this worker's pool into ``dst_page_ids`` of the peer
        that sent ``boot``, then a ``KVPages`` header (``last``: the final message of request
        ``boot.rid``, carrying the first token). Only complete pages may be sent before ``last``.

        The source pages must not be freed or overwritten until :meth:`is_done` says so.

        Raises:
            splitserve.ipc.sockets.PeerUnreachable: the peer does not accept data.
            ValueError: page counts differ, or the peer's endpoint is unusable.
        """

    def poll(self) -> None:
        """Make progress on asynchronous sends (called every worker loop iteration)."""

    def is_done(self, rid: str) -> bool:
        """Whether every send of ``rid`` has finished reading the source pages (they may be
        freed) and, for one-sided backends, writing the destination pages. Forgets ``rid``
        once it returns True."""
        return True

    def cancel(self, rid: str) -> None:
        """Stop sending ``rid``: writes of it that have not started are skipped (their headers
        are never sent). One already running finishes; :meth:`is_done` says when. Backends
        that write synchronously inside :meth:`send` (shm) or never into the peer's pool
        (zmq: the receiver drops frames of a request it no longer has) have nothing to do."""

    def cancel_peer(self, dst_addr: str) -> None:
        """Drop whatever is still queued for ``dst_addr`` (it stopped reading); afterwards the
        source pages of those sends may be freed."""

    def close(self) -> None:
        """Release backend resources (connections, mappings)."""


class BaseKVReceiver(abc.ABC):
    """Decode side. ``metrics`` counts what was installed.

    ``one_sided``: the peer writes into this pool directly (shm, mooncake, nixl), so the pages of a
    request that fails before its last message stay reserved until the prefill side
    acknowledges that it stopped writing them (``KVFailed.ack_addr`` -> ``KVReleased``; the
    fence of ``kv_transfer.recv_session``).
    """

    name = "base"
    one_sided = False

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.metrics = TransferMetrics(self.name)

    def endpoint(self) -> dict[str, str]:
        """What the prefill side needs to reach this pool; sent in every ``KVBootstrap``."""
        return {}

    @abc.abstractmethod
    def install(self, header: KVPages, frames: Frames | list) -> None:
        """Complete one ``KVPages`` message: receive the pages its frames carry into the local
        pool (or check that a one-sided write already put them there), and record metrics.
        ``frames``: the message's raw frames, unread (``splitserve.ipc.frames``) or as a list.
        The caller has checked that ``header.page_ids`` belong to request ``header.rid``.

        Raises:
            ValueError: the frames do not match the header or the pool's layout.
        """

    def close(self) -> None:
        """Release backend resources (shared-memory segments, registrations)."""


@dataclass(frozen=True, slots=True)
class KVTransferBackend:
    """What a backend name gives: the sender (prefill side), the receiver (decode side) and,
    where the prefill side must reach the decode pool's memory itself, how to make that pool
    (shm: a shared-memory segment). ``None``: an ordinary :class:`KVPool`."""

    name: str
    sender: Callable[[KVPool, Outbox], BaseKVSender]
    receiver: Callable[[KVPool], BaseKVReceiver]
    receiving_pool: Callable[[KVLayout, int, str], KVPool] | None = None
