"""The composition root of a worker process: every part built once from its
:class:`~splitserve.config.WorkerConfig` and its role's traits. The only place that loads the
model.

Built in order: the model (``engine.model.loader``) and its weights' identity for the KV
handshake; the KV pool (where the KV transfer backend needs it: shm puts the decode pool in
``/dev/shm``); the prefix cache (roles that compute prompts), the scheduler, the model runner
and the engine core over them; the grammar compile service; the sockets and the port policies
act through; the KV transfer endpoint (sender or receiver) and its sessions.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import torch

from splitserve.config import EngineConfig, WorkerConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.kernels.cpu.build import cpu_kernel_build, load_cpu_kernels
from splitserve.engine.kernels.cpu.features import resolve_dtype
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.lora.manager import LoraManager
from splitserve.engine.model.loader import load_model
from splitserve.engine.runner.cuda_graph import DEFAULT_BATCH_SIZES, DecodeGraphRunner
from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.sched.prefix_cache import BasePrefixCache, NoPrefixCache
from splitserve.engine.sched.request import Req
from splitserve.engine.sched.scheduler import Scheduler
from splitserve.ipc.messages import SamplingParams, WeightsMsg
from splitserve.kv_transfer.base import BaseKVReceiver, BaseKVSender
from splitserve.kv_transfer.recv_session import RecvSessions
from splitserve.kv_transfer.registry import create_kv_pool, create_kv_receiver, create_kv_sender
from splitserve.kv_transfer.send_session import SendSessions
from splitserve.radix_cache.block_hash import KVIdentity
from splitserve.radix_cache.prefix_cache import create_prefix_cache
from splitserve.radix_cache.tiers.factory import create_tiered_cache
from splitserve.worker.grammars import WorkerGrammars, create_worker_grammars
from splitserve.worker.links import open_links
from splitserve.worker.parts import WorkerParts
from splitserve.worker.port import OutboxPort, SessionPort, WorkerPort
from splitserve.worker.role import WorkerRole

if TYPE_CHECKING:
    from splitserve.worker.tracing import WorkerTracer

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 160  # largest decode batch captured as a CUDA graph (engine.cuda_graph)


def build_parts(config: WorkerConfig, role: WorkerRole) -> WorkerParts:
    """Load the model and build every part of a ``role`` worker from ``config``.

    Raises:
        ValueError: an unknown backend or a config the model cannot run with.
        ImportError: an optional package the config asks for is missing.
    """
    e = config.engine
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    c_kernels = (e.dtype == "auto" and e.device == "cpu" and e.cpu_kernels
                 and load_cpu_kernels() is not None)  # auto on AVX2 asks (features.py)
    dtype = resolve_dtype(e.dtype, e.device, c_kernels)[0]
    model, model_config = load_model(e.model, dtype=getattr(torch, dtype), device=e.device,
                                     engine=e)
    # What the KV handshake checks besides the pool layout (the prefill policy refuses a peer
    # with other weights).
    weights = WeightsMsg(model_config.architecture, model_config.fingerprint(), e.quantization,
                         model.weights_digest)
    layout = model_config.kv_layout(e.page_size, dtype, e.kv_cache_dtype)
    num_pages = max(2, e.kv_cache_mb * 2**20 // layout.page_bytes)
    # The backend decides where the pool lives (shm: a segment the prefill side maps).
    pool = create_kv_pool(e.kv_transfer, layout, num_pages, e.device, role.receives_kv)
    lora = create_lora(model, e)
    runner = ModelRunner(
        model, pool, e.device, vocab_size=model_config.vocab_size,
        overlap_grammar_mask=e.overlap_grammar_mask,
        decode_graphs=capture_decode_graphs(model, pool, e) if role.decodes else None,
        use_cpu_kernels=e.cpu_kernels,
        eos_token_ids=model_config.eos_token_ids,
    )
    cache = create_cache(config, role, pool, runner, weights, dtype, model_config.eos_token_ids)
    scheduler = Scheduler(cache, e, model_config.eos_token_ids, prefill_only=not role.decodes,
                          lora=lora)
    grammars = create_worker_grammars(
        e.model, model_config.vocab_size, model_config.eos_token_ids,
        jump_forward=e.jump_forward and role.decodes, default_backend=e.grammar_backend,
        compile_procs=e.grammar_compile_procs, compile_timeout_s=e.grammar_compile_timeout_s,
        compile_queue=e.grammar_compile_queue, test_slow=e.grammar_test_slow,
        cache_bytes=e.grammar_cache_mb * 2**20,
    )
    links = open_links(config, watch_links=role.receives_kv)
    port = OutboxPort(links.outbox)
    sender = create_kv_sender(e.kv_transfer, pool, links.outbox) if role.sends_kv else None
    receiver = create_kv_receiver(e.kv_transfer, pool) if role.receives_kv else None
    kernels = kernel_report(model, e)
    if e.device == "cpu" and e.cpu_kernels and cpu_kernel_build().failed:
        logger.error("%s worker %s: %s", role.name, config.worker_id, kernels)
    logger.info(
        "%s worker %s: %s, %s on %s (%s attention), %d KV pages of %d tokens "
        "(KV %s, %.0f bytes/token), %s, inbox %s",
        role.name, config.worker_id, e.model, dtype, e.device,
        type(model.attn_backend).__name__, num_pages - 1, e.page_size,
        e.kv_cache_dtype, layout.bytes_per_token, kernels, config.addr,
    )
    return WorkerParts(
        config, dtype, model_config, weights, pool, scheduler, EngineCore(scheduler, runner),
        grammars, links, port, sender, receiver,
        create_sessions(config, scheduler, grammars, port, sender, receiver), lora,
        create_worker_tracer(config, role),
    )


def create_lora(model: torch.nn.Module, engine: EngineConfig) -> LoraManager | None:
    """The worker's LoRA adapters when the config serves them (``EngineConfig.lora_enabled``),
    with ``lora_modules`` loaded (``pinned_loras`` pinned); else None.

    Raises:
        ValueError (``engine.lora.peft.LoraError``): an adapter of ``lora_modules`` that cannot
            be served, named with its problem.
    """
    if not engine.lora_enabled:
        return None
    lora = LoraManager(model, engine.max_loras, engine.max_lora_rank, engine.max_loaded_loras)
    for name, path in engine.lora_modules.items():
        try:
            adapter = lora.load(name, path, pinned=name in engine.pinned_loras)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {name}={path}: {exc}") from exc
        logger.info("LoRA adapter %s: rank %d from %s (%.0f ms)", name, adapter.rank, path,
                    adapter.load_s * 1e3)
    return lora


def create_worker_tracer(config: WorkerConfig, role: WorkerRole) -> WorkerTracer | None:
    """The worker's spans of traced requests (``worker.tracing``), exported to
    ``config.tracing.otlp_traces_endpoint``; None when tracing is off (nothing of
    OpenTelemetry imported)."""
    if not config.tracing.enabled:
        return None
    from splitserve.observe.otel import create_trace_export
    from splitserve.worker.tracing import WorkerTracer

    export = create_trace_export(config.tracing, f"splitserve-{role.name}", config.worker_id,
                                 follow_parent_only=True)
    return WorkerTracer(export, role.name, config.worker_id)


def create_cache(config: WorkerConfig, role: WorkerRole, pool: KVPool, runner: ModelRunner,
                 weights: WeightsMsg, dtype: str, eos_token_ids: list[int]) -> BasePrefixCache:
    """The prefix cache of a role that computes prompts: the radix tree with the cache tiers the
    config names below it (``radix_cache.tiers.factory``: it also publishes KV events, with or
    without tiers), measured against this model's prefill rate when a tier reads from disk or
    the store; the no-op cache for the decode role or ``--prefix-cache none``."""
    e = config.engine
    if not role.computes_prompts or e.prefix_cache != "radix":
        kind = e.prefix_cache if role.computes_prompts else "none"
        return create_prefix_cache(kind, pool.allocator, pool.page_size)
    layout = pool.layout
    w = weights
    identity = KVIdentity(
        f"{w.architecture}/{w.config_fingerprint}/{w.quantization}/{w.weights_digest}", dtype,
        f"{layout.num_layers}x{layout.num_kv_heads}x{layout.head_dim}/{layout.kv_cache_dtype}",
        layout.page_size)
    host = urlparse(config.addr).hostname or "127.0.0.1"
    cache = create_tiered_cache(e, pool, identity, local_host=host)
    if e.kv_disk_cache_dir or e.kv_store:
        tokens, seconds = probe_prefill(runner, pool, e, eos_token_ids)
        cache.observe_prefill(tokens, seconds)
        logger.info("prefill probe: %.0f tokens/s; tier loads at %s GB/s", tokens / seconds,
                    {t: round((r.value or 0) / 1e9, 2) for t, r in cache.cost.loads.items()})
    return cache


def probe_prefill(runner: ModelRunner, pool: KVPool, engine: EngineConfig,
                  eos_token_ids: list[int], num_tokens: int = 128) -> tuple[int, float]:
    """``(tokens, seconds)`` of one prompt's forward passes on this model, pool and threads
    (after a short one that pays the one-time set-up): the prefill rate that loading a cached
    prefix from disk or the store is weighed against."""
    num_tokens = min(num_tokens, (pool.allocator.num_pages - 2) * pool.page_size)
    seconds = 0.0
    for n in (min(16, num_tokens), num_tokens):
        scheduler = Scheduler(NoPrefixCache(pool.allocator, pool.page_size), engine,
                              eos_token_ids, prefill_only=True)
        req = Req("prefill-probe", [1 + i % 100 for i in range(n)],
                  SamplingParams(max_new_tokens=1, temperature=0.0))
        scheduler.add(req)
        start = time.perf_counter()
        while scheduler.has_work:
            batch = scheduler.schedule()
            if batch is None:
                break
            scheduler.update(batch, runner.run(batch))
        seconds = time.perf_counter() - start
        scheduler.release(req)
    return num_tokens, max(seconds, 1e-9)


def create_sessions(
    config: WorkerConfig,
    scheduler: Scheduler,
    grammars: WorkerGrammars,
    port: WorkerPort,
    sender: BaseKVSender | None = None,
    receiver: BaseKVReceiver | None = None,
) -> SendSessions | RecvSessions | None:
    """The KV transfer sessions of a worker with a ``sender`` (send sessions) or a ``receiver``
    (receive sessions; None for neither). They act through a
    :class:`~splitserve.worker.port.SessionPort` (pages released through ``scheduler``) and
    read ``port``'s clock."""
    session_port = SessionPort(port, scheduler, grammars, receiver)
    timeout_s = config.engine.transfer_timeout_s
    if sender is not None:
        return SendSessions(sender, session_port, scheduler.page_size, timeout_s,
                            clock=port.now)
    if receiver is not None:
        return RecvSessions(session_port, receiver.one_sided, config.addr, timeout_s,
                            clock=port.now)
    return None


def capture_decode_graphs(
    model: torch.nn.Module, pool: KVPool, engine: EngineConfig
) -> DecodeGraphRunner | None:
    """CUDA graphs for decode steps of up to ``max_running`` rows (at most
    ``MAX_GRAPH_BATCH``: larger steps run eagerly, where launches are a small share), on CUDA
    unless ``--disable-cuda-graph``; else None. For roles that decode."""
    if (
        not engine.cuda_graph
        or torch.device(engine.device).type != "cuda"
        or not model.attn_backend.supports_cuda_graphs
    ):
        return None
    largest = min(engine.max_running, MAX_GRAPH_BATCH)
    sizes = tuple(n for n in DEFAULT_BATCH_SIZES if n < largest)
    return DecodeGraphRunner(model, pool, sizes + (largest,))


def kernel_report(model: torch.nn.Module, engine: EngineConfig) -> str:
    """What serves the decode-step products, in words (the start-up line, ``WorkerStats``):
    the kernel plan where there is one, else whether the CPU C kernels are off, built, or
    missing (no compiler; or BUILD FAILED, with the cause)."""
    plan = model.kernel_plan.summary() if model.kernel_plan else ""
    if torch.device(engine.device).type != "cpu":
        return plan
    if not engine.cpu_kernels:
        return "C kernels off (--disable-cpu-kernels)"
    build = cpu_kernel_build()  # already built (or tried) by the model's layers
    return plan if plan and build.kernels is not None else build.describe()
