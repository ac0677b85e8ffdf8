"""Every message that crosses a process boundary, as one tagged union of ``msgspec.Struct`` types.

Encoded as msgpack by :func:`encode` / :func:`decode`. Bulk KV data never goes through msgspec:
it travels as raw ZeroMQ frames after the header frame (see ``kv_transfer.zmq_backend``).
No pickle anywhere: a frame that is not a valid message of this union is rejected by ``decode``.
"""

from __future__ import annotations

import enum

import msgspec


class FailureKind(enum.StrEnum):
    """Why a worker failed a request, as it travels (``RequestError.kind``, ``KVFailed.kind``).

    On the wire it is a plain string, so a reader older or newer than the sender still decodes
    the message; :meth:`parse` maps a string back (an unknown one to ``default``).
    """

    INVALID = "invalid"  # the task cannot run on this worker (prompt too long, ...): a 400
    GRAMMAR = "grammar"  # its constraint did not compile, or refused the first token
    TRANSFER = "transfer"  # its KV handoff failed, timed out, or was refused at the handshake
    ROUTER_GONE = "router_gone"  # the router that sent it went away: nobody to stream to

    @classmethod
    def parse(cls, value: str, default: FailureKind) -> FailureKind:
        """The kind named ``value``, or ``default`` when it names none (an older sender)."""
        try:
            return cls(value)
        except ValueError:
            return default


class Constraint(msgspec.Struct, frozen=True):
    """A grammar the output must match (docs/design.md, "Structured generation").

    ``kind`` is one of ``engine.grammar.GRAMMAR_KINDS``: ``json_schema`` (``text`` is the schema
    as JSON), ``json_object`` (``text`` ignored), ``regex``, ``ebnf`` (a GBNF grammar with a
    ``root`` rule), ``choice`` (``text`` is a JSON list of strings) or ``structural_tag``
    (xgrammar's structural tag JSON: the tool-call envelope, ``server.tools.grammar``).
    """

    kind: str
    text: str = ""
    # json_schema: only a backend that enforces every keyword may compile it (else a 400).
    strict: bool = False
    # JSON kinds: free whitespace between tokens (the default is compact JSON).
    whitespace_flexible: bool = False


class ReasoningParams(msgspec.Struct, frozen=True):
    """The think block of a reasoning model's answer, as the engine enforces it (docs/api.md,
    "Reasoning"): the request's constraint starts only after the block, and the block ends by
    force after ``budget`` tokens. Sent only where the engine has something to do: a
    constraint, or a budget (free thinking without a budget is the server's parsing alone).

    ``start_ids`` / ``end_ids``: the markers as the model's tokenizer writes them on their own
    (a model opens the block with exactly ``start_ids``; the budget forces exactly ``end_ids``);
    ``end_text``: the end marker's text, found in the output at the byte level whatever tokens
    spell it; ``opened``: the prompt opened the block, so the answer starts inside it (else the
    model may open it as its first tokens); ``budget``: thinking tokens at most, -1 for none.
    """

    start_ids: list[int]
    end_ids: list[int]
    end_text: str
    opened: bool
    budget: int = -1


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each next token. Units: tokens.

    ``top_k <= 0`` and ``top_p == 1`` and ``min_p == 0`` disable those filters;
    ``temperature == 0`` is greedy. Generation stops at ``max_new_tokens`` (finish ``length``),
    at an EOS id of the model unless ``ignore_eos``, or at any of ``stop_token_ids`` (finish ``stop``).
    ``constraint`` rides here (as in SGLang/vLLM) so it reaches every worker's ``Req`` with the
    rest of the request's sampling; a constrained request also stops when its grammar ends.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Prompt logprobs (echo/logprobs, ``lang.select``): -1 asks for none; otherwise the logprob of
    # every prompt token at index >= max(1, logprob_start_len) comes back with the first token.
    # A start past a shared prefix lets that prefix stay cacheable (only later positions scored).
    logprob_start_len: int = -1
    constraint: Constraint | None = None
    # Logits processing (engine.runner.penalties), applied where each token is sampled, in this
    # order: ``logit_bias`` (token id -> added to its logit), ``min_tokens`` (EOS and
    # ``stop_token_ids`` masked until that many tokens were generated), ``repetition_penalty``
    # (vLLM: over prompt + output, positive logits divided, negative multiplied; 1 is off), then
    # ``frequency_penalty`` x count and ``presence_penalty`` x seen over the output (OpenAI).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    # Alternatives per token (0-20) returned with each sampled token, and with each scored prompt
    # token: the most likely ids of the raw distribution (log-softmax before any processing).
    top_logprobs: int = 0
    # A reasoning model's think block (None: none, or nothing for the engine to enforce):
    # ``constraint`` applies after it, and it ends by force at its budget (engine.grammar.think).
    reasoning: ReasoningParams | None = None

    @property
    def needs_grammar(self) -> bool:
        """Whether the request's tokens go through a grammar (a constraint, or a think block the
        engine enforces): its worker prepares one before scheduling it."""
        return self.constraint is not None or self.reasoning is not None
    # Scheduling priority (vLLM's semantics): lower values are admitted first and preempted
    # last when KV pages run out (engine.sched.scheduler); equal values in arrival order.
    priority: int = 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.logprob_start_len >= 0

    @property
    def has_penalties(self) -> bool:
        """Whether any logits processing other than ``min_tokens`` is asked for."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


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


class LoraRef(msgspec.Struct, frozen=True):
    """The LoRA adapter a request runs under: ``name`` (the ``model`` the client sent) and
    ``path``, its PEFT folder, from which a worker that has not loaded it (restarted, joined
    later) loads it before the request runs."""

    name: str
    path: str


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


class TierStats(msgspec.Struct, kw_only=True):
    """One KV cache tier of a worker (``WorkerStats.cache_tiers``): its size and use (bytes,
    blocks of one page each) and what it did since start. ``hit_tokens``: prompt tokens it
    served; loads and writes in blocks, bytes and seconds; ``write_errors`` (disk full, store
    full or gone), ``dropped_writes`` (the write queue was full), ``corrupt_blocks`` (failed
    their checks when read), ``unavailable`` (loads skipped: the tier did not answer) and
    ``skipped_slower`` (blocks not loaded because recomputing them was measured faster) each
    cost a recompute, never a wrong token. ``load_gbps``: the measured load rate."""

    tier: str  # "l1" | "l2" | "l3" | "store"
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    hit_tokens: int = 0
    load_blocks: int = 0
    load_bytes: int = 0
    load_s: float = 0.0
    write_blocks: int = 0
    write_bytes: int = 0
    write_errors: int = 0
    dropped_writes: int = 0
    corrupt_blocks: int = 0
    unavailable: int = 0
    skipped_slower: int = 0
    load_gbps: float = 0.0


class WorkerStats(msgspec.Struct, tag="stats", kw_only=True):
    query_id: int
    worker_id: str
    role: str
    pages_total: int
    pages_used: int
    num_running: int
    num_waiting: int
    num_transferring: int = 0
    # Prefix cache (zeros where off). Pages of ``page_size`` tokens; counters since start.
    cache_pages: int = 0  # pages the cache owns (part of pages_used)
    cache_evictable_pages: int = 0  # of those, pages no request pins
    cache_hit_tokens: int = 0  # prompt tokens served from the cache
    cache_prompt_tokens: int = 0  # prompt tokens admitted
    cache_evicted_pages: int = 0  # pages evicted (pool pressure or flush)
    # KV transfer (kv_transfer.metrics.TransferMetrics): the backend, what this worker sent
    # (prefill) or installed (decode), and the install latency histogram (decode: from the
    # sender's send call to the pages being in this pool; bucket upper bounds in ms, and
    # ``kv_latency_counts`` has one more entry: slower than the last bound).
    kv_transfer: str = ""
    kv_bytes_sent: int = 0
    kv_pages_sent: int = 0
    kv_messages_sent: int = 0
    kv_send_s: float = 0.0
    kv_bytes_received: int = 0
    kv_pages_received: int = 0
    kv_messages_received: int = 0
    kv_latency_ms_buckets: list[float] = []
    kv_latency_counts: list[int] = []
    kv_latency_ms_sum: float = 0.0
    kv_gbps: float = 0.0  # bytes over summed per-message latency (receiver) or send time (sender)
    transfer_failures: int = 0  # requests this worker failed because their KV transfer failed
    requests_failed: int = 0
    # Requests ended here because their router went away (its link dropped, or it sent no
    # RouterBeat for its dead_after_s): their pages freed, nobody left to stream to.
    requests_orphaned: int = 0
    # Memory (bytes): the KV pool, the attention backend's copy of the decoding rows' K/V (CPU
    # bfloat16; freed when nothing decodes), and the weights with their packed copies.
    kv_pool_bytes: int = 0
    kv_cache_dtype: str = "auto"  # how the pool stores K/V (--kv-cache-dtype)
    decode_cache_bytes: int = 0
    weight_bytes: int = 0
    # Which kernel serves the decode-step products (engine.model.kernel_plan), in words; on
    # CPU without a plan, the C kernels' state ("C kernels: BUILD FAILED (cause), torch ops").
    kernel_plan: str = ""
    # Speculative decoding since start: draft tokens proposed, and those verification kept.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    node: str = ""  # the node the worker runs on (WorkerConfig.node: a Ray node id, or the host)
    # LoRA adapters (engine.lora): loaded here, and of those the ones in a slot now (the
    # router prefers a worker where a request's adapter is resident).
    loras: list[str] = []
    loras_resident: list[str] = []
    # Name -> digest of each loaded adapter's files (engine.lora.peft.adapter_digest): what this
    # worker folds into a request's prefix-cache namespace, hence into its blocks' keys; the
    # router folds the same into the namespace it matches KV events in (server.worker_pool).
    lora_digests: dict[str, str] = {}
    tokens_generated: int = 0  # output tokens this worker sent to routers since start
    # KV cache tiers under the prefix cache (radix_cache.tiers), one row each ("l1" first: the
    # pool's cached pages), and the measured prefill rate their loads are weighed against.
    cache_tiers: list[TierStats] = []
    prefill_tokens_per_s: float = 0.0


# ---- KV events (worker -> router) ------------------------------------------------------------


class KVEvent(msgspec.Struct, array_like=True):
    """A change of where blocks live on a worker: ``stored`` (now in ``tier``), ``removed``
    (no longer in ``tier``) or ``demoted`` (moved from ``from_tier`` down to ``tier``). Blocks
    are named by their content address (``radix_cache.block_hash``)."""

    kind: str
    tier: str  # "l1" | "l2" | "l3" | "store"
    keys: list[str]
    from_tier: str = ""


class KVEvents(msgspec.Struct, tag="kv_events", kw_only=True):
    """Worker -> every router it reports to: its cache tiers' changes since the previous
    message (``seq``: 1, 2, ... from the worker's start), or, with ``snapshot``, every block it
    holds now (the answer to :class:`KVEventsQuery`). ``identity`` and ``page_size`` let the
    router compute the same block keys from a prompt (``block_hash.KVIdentity.digest``);
    ``store``: the shared store the worker reads (its blocks count for every worker of it)."""

    worker_id: str
    addr: str
    identity: str
    page_size: int
    seq: int
    events: list[KVEvent]
    snapshot: bool = False
    store: str = ""


class KVEventsQuery(msgspec.Struct, tag="kv_events_query"):
    """Router -> worker: send a snapshot of your blocks (a router that joined late, or missed
    events: a gap in ``seq``) to ``reply_addr``."""

    reply_addr: str


# ---- decode <-> prefill (KV transfer control) ----------------------------------------------


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
