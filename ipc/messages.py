"""Every message that crosses a process boundary, as one tagged union of ``msgspec.Struct`` types.

Encoded as msgpack by :func:`encode` / :func:`decode`. Bulk KV data never goes through msgspec:
it travels as raw ZeroMQ frames after the header frame (see ``kv_transfer.zmq_backend``).
No pickle anywhere: a frame that is not a valid message of this union is rejected by ``decode``.

This module holds the union, the server <-> worker messages of a request's life and the codec;
the rest live by idea in sibling modules and are re-exported here, so every message is imported
from ``splitserve.ipc.messages``: a request's sampling (``ipc.sampling``), why a request failed
(``ipc.failure``), the KV transfer's control messages (``ipc.kv_messages``), KV events
(``ipc.kv_events``) and a worker's stats (``ipc.worker_stats``).
"""

from __future__ import annotations

import msgspec

from splitserve.ipc.failure import FailureKind
from splitserve.ipc.kv_events import KVEvent, KVEvents, KVEventsQuery
from splitserve.ipc.kv_messages import (
    KVBootstrap,
    KVFailed,
    KVKeepalive,
    KVLayoutMsg,
    KVPages,
    KVQueued,
    KVReleased,
    WeightsMsg,
)
from splitserve.ipc.sampling import Constraint, LoraRef, ReasoningParams, SamplingParams
from splitserve.ipc.worker_stats import TierStats, WorkerStats

__all__ = [
    "AbortTask",
    "Constraint",
    "FailureKind",
    "FlushCache",
    "GenerateTask",
    "KVBootstrap",
    "KVEvent",
    "KVEvents",
    "KVEventsQuery",
    "KVFailed",
    "KVKeepalive",
    "KVLayoutMsg",
    "KVPages",
    "KVQueued",
    "KVReleased",
    "LoadLora",
    "LoraRef",
    "LoraReply",
    "Message",
    "ReasoningParams",
    "RequestError",
    "RouterBeat",
    "SamplingParams",
    "Shutdown",
    "StageStamps",
    "StatsQuery",
    "TierStats",
    "TokenBatch",
    "TokenOutput",
    "UnloadLora",
    "WeightsMsg",
    "WorkerReady",
    "WorkerStats",
    "decode",
    "encode",
]


# ---- server -> worker -------------------------------------------------------------------------


class GenerateTask(msgspec.Struct, tag="generate", kw_only=True):
    """Start request ``rid``. Sent to the prefill and the decode worker at once.

    ``prefill_addr`` is set on the decode worker's copy: where it sends the bootstrap.
    ``cache_namespace``: the prefix-cache namespace (tenant key and ``cache_salt``, hashed by
    the server); requests of different namespaces never share cached pages. None: the shared one.
    """

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    reply_addr: str
    prefill_addr: str | None = None
    cache_namespace: str | None = None
    lora: LoraRef | None = None  # the LoRA adapter it runs under (None: the base model)
    # W3C trace context (``00-<trace id>-<parent span id>-<flags>``) of the router's span for
    # this attempt, when the request is traced: the worker's spans join that trace as its
    # children (``worker.tracing``). None: not traced (tracing off, or not sampled).
    traceparent: str | None = None


class AbortTask(msgspec.Struct, tag="abort"):
    """Stop request ``rid`` and free its pages (client went away, stop string matched)."""

    rid: str


class StatsQuery(msgspec.Struct, tag="stats_query"):
    query_id: int
    reply_addr: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class RouterBeat(msgspec.Struct, tag="router_beat"):
    """The router (API server) whose inbox is ``reply_addr`` is alive; sent to every worker
    twice a second. A worker that hears none for ``dead_after_s`` seconds (the router's own
    ``--dead-after``, so both ends of a link use one bound) ends that router's requests and
    frees their pages (``worker.routers``)."""

    reply_addr: str
    dead_after_s: float


class FlushCache(msgspec.Struct, tag="flush_cache"):
    """Drop every prefix-cache entry no running request pins; the worker answers with its
    ``WorkerStats`` (``query_id``) once done, so a caller can wait for the flush."""

    query_id: int
    reply_addr: str


class LoadLora(msgspec.Struct, tag="load_lora"):
    """Load the LoRA adapter in PEFT folder ``path`` as ``name`` (replacing a load of that name);
    ``pinned``: keep it in a slot. The worker answers :class:`LoraReply` (``query_id``) to
    ``reply_addr`` once loaded or refused, serving meanwhile."""

    query_id: int
    reply_addr: str
    name: str
    path: str
    pinned: bool = False


class UnloadLora(msgspec.Struct, tag="unload_lora"):
    """Forget adapter ``name`` (requests already admitted under it finish under it); answered
    by :class:`LoraReply`."""

    query_id: int
    reply_addr: str
    name: str


# ---- worker -> server -------------------------------------------------------------------------


class LoraReply(msgspec.Struct, tag="lora_reply", kw_only=True):
    """The answer to :class:`LoadLora` / :class:`UnloadLora`: ``error`` "" when done, else why
    not (the adapter's problem, as a 400 names it); a load's adapter ``digest``, ``rank`` and
    seconds to read it (``load_s``)."""

    query_id: int
    worker_id: str
    name: str
    error: str = ""
    digest: str = ""
    rank: int = 0
    load_s: float = 0.0


class WorkerReady(msgspec.Struct, tag="ready"):
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    addr: str


class StageStamps(msgspec.Struct, kw_only=True):
    """When one request passed each stage boundary on a worker, in wall-clock seconds
    (``time.time()``; 0 where not reached or not this worker's). Wall clock, not monotonic, so
    the router can lay the stamps of several processes on one time line (on one host exactly;
    across hosts as well as their clocks agree, as ``KVPages.sent_at``). The router turns them
    into the request's timing breakdown (``observe.timing``).

    Prefill and colocated workers: ``received`` (task in), ``scheduled`` (its first prompt
    chunk started), ``first_token`` (the step that sampled it ended). Decode workers:
    ``decode_received``, ``kv_ready`` (its last KV pages installed). Decode and colocated:
    ``first_step`` (its first decode step ended), ``last`` (its last token was emitted) and
    ``steps`` (decode steps it took part in).
    """

    received: float = 0.0
    scheduled: float = 0.0
    first_token: float = 0.0
    decode_received: float = 0.0
    kv_ready: float = 0.0
    first_step: float = 0.0
    last: float = 0.0
    steps: int = 0


class TokenOutput(msgspec.Struct, kw_only=True):
    """New tokens of one request. ``index`` is the output position of ``token_ids[0]`` (0 = first
    generated token), so the server can order tokens that come from two workers."""

    rid: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None  # "stop" | "length"
    prompt_len: int = 0
    cached_len: int = 0
    # Of ``cached_len``, the tokens each cache tier served ("l1": the KV pool, "l2": host memory,
    # "l3": the disk, "store": the shared store); empty where no tier is configured (all "l1").
    cached_by_tier: dict[str, int] = {}
    # Set on the output with index 0 when ``sampling.logprob_start_len >= 0``: logprobs of prompt
    # tokens ``max(1, logprob_start_len) .. prompt_len - 1`` (the first token has none).
    prompt_logprobs: list[float] | None = None
    # When ``sampling.top_logprobs > 0``: per token of ``token_ids`` (resp. ``prompt_logprobs``)
    # the most likely ids and their raw logprobs, most likely first (empty for a token the
    # grammar forced, which was not sampled).
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None
    # The worker's stage stamps: on the first output (index 0) and on the last (finish_reason
    # set), None on the others.
    stamps: StageStamps | None = None
    # On the first output a worker sends for a constrained request (the prefill or colocated
    # worker's: index 0; the decode worker's: its first own): the grammar backend whose compile
    # it uses and the schema keywords that backend ignores (``"keyword at /pointer"``); ""/[]
    # on the others and for free text. The API server's partial header and violation label.
    grammar_backend: str = ""
    grammar_ignored: list[str] = []


class TokenBatch(msgspec.Struct, tag="tokens"):
    outputs: list[TokenOutput]


class RequestError(msgspec.Struct, tag="error"):
    """Request ``rid`` failed on a worker; ``message`` says why. ``code`` is an HTTP status.
    ``kind``: a :class:`FailureKind` value ("" from a worker that predates it)."""

    rid: str
    message: str
    code: int = 500
    kind: str = ""


Message = (
    GenerateTask
    | AbortTask
    | StatsQuery
    | Shutdown
    | RouterBeat
    | FlushCache
    | LoadLora
    | UnloadLora
    | LoraReply
    | WorkerReady
    | TokenBatch
    | RequestError
    | WorkerStats
    | KVBootstrap
    | KVPages
    | KVKeepalive
    | KVFailed
    | KVQueued
    | KVReleased
    | KVEvents
    | KVEventsQuery
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    """Decode one header frame.

    Raises:
        msgspec.ValidationError / msgspec.DecodeError: the frame is not a message of this union.
    """
    return _decoder.decode(data)
