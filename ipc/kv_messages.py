"""The KV transfer's control messages between a decode and a prefill worker (the handshake,
the page headers, keepalives, failures and their acknowledgement), and the layout and weights
that the handshake checks. The pages themselves travel as raw frames (``kv_transfer``).
"""

from __future__ import annotations

import msgspec

from splitserve.ipc.failure import FailureKind


class KVLayoutMsg(msgspec.Struct, frozen=True):
    """Wire form of ``engine.kv_pool.KVLayout``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    kv_cache_dtype: str = "auto"  # "int8" / "fp8_e4m3": 8-bit values + per-token-head scales


class WeightsMsg(msgspec.Struct, frozen=True):
    """Which weights a worker serves: what the KV handshake checks besides the pool layout.

    ``config_fingerprint`` is ``ModelConfig.fingerprint()`` (a hash of the parsed model
    config: two checkpoints of one shape and family agree on it, fine-tunes included);
    ``quantization`` is ``EngineConfig.quantization`` ("none", "int8", "int4");
    ``weights_digest`` is the loaded model's ``weights_digest`` (``engine.model.weight_digest``:
    16 hex digits over a fixed sample of every checkpoint tensor's values as loaded, before
    quantization), which tells apart checkpoints whose configs agree, such as two fine-tunes of
    one base. It defaults to "" so that a worker of an earlier version, which does not send it,
    is refused by name at the handshake (the digests differ) instead of failing to decode.
    """

    architecture: str
    config_fingerprint: str
    quantization: str
    weights_digest: str = ""


class KVBootstrap(msgspec.Struct, tag="kv_bootstrap", kw_only=True):
    """Decode -> prefill: request ``rid`` has pages ``page_ids`` reserved at ``dst_addr``."""

    rid: str
    dst_addr: str
    page_ids: list[int]
    layout: KVLayoutMsg
    kv_transfer: str = "zmq"  # backend name; the prefill worker refuses one that is not its own
    # The decode worker's weights; the prefill worker refuses a bootstrap whose weights differ
    # from its own, or that does not say (None), as their KV would not be the decode model's.
    weights: WeightsMsg | None = None
    endpoint: dict[str, str] = {}  # backend-specific: where the pages live (shm segment, ...)
    # The LoRA adapter the decode worker runs the request under (its digest, "" for the base
    # model); the prefill worker refuses a bootstrap whose adapter is not the request's there.
    lora: str = ""


class KVPages(msgspec.Struct, tag="kv_pages", kw_only=True):
    """Prefill -> decode header; followed by ``num_frames`` raw frames holding the pages, in
    ``page_ids`` order (zmq backend: frame ``i`` holds the next ``frame_pages[i]`` pages, so the
    receiver knows where each frame goes before reading it; backends that write into the decode
    pool directly send no frames). A request's pages come in several messages: chunk by chunk as
    the prompt is computed, and each chunk split into messages of a few MiB; ``last`` marks the
    final one, which carries the first generated token so the decode worker can continue."""

    rid: str
    page_ids: list[int]
    num_frames: int
    last: bool
    frame_pages: list[int] = []  # pages per frame (zmq); sums to len(page_ids)
    sent_at: float = 0.0  # sender's time.time() when it started this message (latency metric)
    first_token: int = -1
    first_logprob: float = 0.0
    finished: bool = False


class KVKeepalive(msgspec.Struct, tag="kv_keepalive"):
    """Prefill -> decode: ``rid`` is alive here (queued or computing) though no page is ready to
    send. Sent once as the acknowledgement of the :class:`KVBootstrap`, then every
    ``transfer_timeout / 3`` without other news until the first token: the decode worker's stall
    timer restarts on every message of the request, so a long prefill queue is not a stall,
    while a prefill worker that dies or hangs still times out there."""

    rid: str


class KVFailed(msgspec.Struct, tag="kv_failed"):
    """Either side: the transfer of ``rid`` failed; the receiver frees its pages.

    Decode -> prefill with ``ack_addr`` (one-sided backends, which write into the decode pool
    without the decode worker's involvement): stop writing ``rid``'s pages and, once no write of
    it is in flight, answer :class:`KVReleased` to ``ack_addr``. The decode worker keeps the pages
    out of use until then.

    ``kind``: a :class:`FailureKind` value, what the receiver reports the request's failure as:
    ``transfer`` (the default, and what a sender that predates the field means) unless the
    sender failed the request for another cause (``grammar``: its constraint did not compile).
    """

    rid: str
    message: str
    ack_addr: str = ""
    kind: str = FailureKind.TRANSFER.value


class KVQueued(msgspec.Struct, tag="kv_queued"):
    """Decode -> prefill: ``rid`` still waits in the decode worker's admission queue for pages
    to reserve (running requests hold them), so the prefill worker keeps the prompt's KV and
    goes on waiting for the :class:`KVBootstrap`. Sent every ``transfer_timeout / 3`` while the
    request is queued: a long queue is not a stall, silence is."""

    rid: str


class KVReleased(msgspec.Struct, tag="kv_released"):
    """Prefill -> decode: the acknowledgement of a ``KVFailed`` with ``ack_addr``. The prefill
    worker will not write ``rid``'s pages again; the decode worker may reuse them."""

    rid: str
