"""A worker's answer to ``StatsQuery`` (and to ``FlushCache``): its pool, queues, prefix
cache, KV transfer, memory, adapters and cache tiers, as ``/workers`` and ``/metrics`` show them.
"""

from __future__ import annotations

import msgspec


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
    # Steps given up between layers for a more urgent prompt (engine.step_interrupt).
    steps_interrupted: int = 0
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
