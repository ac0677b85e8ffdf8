"""What every worker process shares: model and KV pool set-up, the ZeroMQ inbox/outbox, the main
loop (drain messages, check timeouts, run one engine step) and stats. Roles subclass it:
``prefill.worker.PrefillWorker``, ``decode.worker.DecodeWorker`` and
``worker.colocated.ColocatedWorker``; what differs between them at set-up is said by three class
attributes (:attr:`BaseWorker.computes_prompts`, :attr:`~BaseWorker.decodes`,
:attr:`~BaseWorker.receives_kv`), never by comparing role names.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
import weakref
from collections.abc import Callable
from typing import ClassVar

import msgspec
import torch
import zmq

from splitserve.config import EngineConfig, WorkerConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.kernels.cpu.build import cpu_kernel_build
from splitserve.engine.kernels.cpu.features import resolve_dtype
from splitserve.engine.model.loader import load_model
from splitserve.engine.runner.cuda_graph import DEFAULT_BATCH_SIZES, DecodeGraphRunner
from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.sched.batch import StepOutput
from splitserve.engine.sched.request import Req
from splitserve.engine.sched.scheduler import Scheduler
from splitserve.ipc.frames import Frames
from splitserve.ipc.messages import (
    AbortTask,
    FlushCache,
    GenerateTask,
    Message,
    RequestError,
    RouterBeat,
    Shutdown,
    StatsQuery,
    TokenBatch,
    TokenOutput,
    WeightsMsg,
    WorkerReady,
    WorkerStats,
)
from splitserve.ipc.sockets import Inbox, Outbox, PeerUnreachable
from splitserve.kv_transfer.registry import create_kv_pool
from splitserve.kv_transfer.session import IllegalTransition
from splitserve.radix_cache.prefix_cache import create_prefix_cache
from splitserve.worker.grammars import CompileDone, create_worker_grammars
from splitserve.worker.heartbeat import Heartbeat, rejoin_router
from splitserve.worker.routers import CHECK_S, RouterWatch

logger = logging.getLogger(__name__)

MAX_MESSAGES_PER_STEP = 256  # bound the time spent draining the inbox between forward passes
MAX_GRAPH_BATCH = 160  # largest decode batch captured as a CUDA graph (engine.cuda_graph)
COMPILE_POLL_MS = 5  # inbox wait while only grammar compiles are pending (no busy loop)


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


class BaseWorker:
    """One worker process. Call :meth:`serve_forever`.

    A role subclass sets :attr:`role` and the three traits below, and implements the hooks
    (``on_generate``, ``on_abort``, ``on_step_outputs``, ``on_grammar_done``; optionally
    ``on_peer_message``, ``check_timeouts``).
    """

    role: ClassVar[str] = "base"
    computes_prompts: ClassVar[bool] = True  # prefills new prompts: the prefix cache applies
    decodes: ClassVar[bool] = True  # keeps requests after their first token: jump-forward, graphs
    receives_kv: ClassVar[bool] = False  # its pool is filled by KV transfer; it watches the links

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        e = config.engine
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(e.dtype, e.device)[0]
        model, self.model_config = load_model(
            e.model, dtype=getattr(torch, self.dtype), device=e.device, engine=e
        )
        # What the KV handshake checks besides the pool layout (prefill.worker refuses a peer
        # with other weights).
        self.weights = WeightsMsg(
            self.model_config.architecture, self.model_config.fingerprint(), e.quantization,
            model.weights_digest,
        )
        layout = self.model_config.kv_layout(e.page_size, self.dtype, e.kv_cache_dtype)
        num_pages = max(2, e.kv_cache_mb * 2**20 // layout.page_bytes)
        # The backend decides where the pool lives (shm: a segment the prefill side maps).
        self.pool = create_kv_pool(e.kv_transfer, layout, num_pages, e.device, self.receives_kv)
        cache = create_prefix_cache(
            e.prefix_cache if self.computes_prompts else "none",
            self.pool.allocator, self.pool.page_size,
        )
        self.scheduler = Scheduler(
            cache, e, self.model_config.eos_token_ids, prefill_only=not self.decodes
        )
        self.runner = ModelRunner(
            model, self.pool, e.device, vocab_size=self.model_config.vocab_size,
            overlap_grammar_mask=e.overlap_grammar_mask,
            decode_graphs=self._capture_decode_graphs(model),
            use_cpu_kernels=e.cpu_kernels,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        self.core = EngineCore(self.scheduler, self.runner)
        self.grammars = create_worker_grammars(
            e.model,
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
            jump_forward=e.jump_forward and self.decodes,
            default_backend=e.grammar_backend,
        )
        self.ctx = zmq.Context()
        self.curve = self.auth = None
        if config.security.curve_keys:
            from splitserve.ipc.security import CurveKeys, start_authenticator

            self.curve = CurveKeys.load(config.security.curve_keys)
            self.auth = start_authenticator(self.ctx, self.curve)
        self.inbox = Inbox(self.ctx, config.addr, self.curve)
        # A worker that receives KV watches its links to prefill workers: a dropped one frees
        # the pages fenced for that worker at once (kv_transfer.recv_session).
        self.outbox = Outbox(self.ctx, self.curve, watch_links=self.receives_kv)
        # Every deadline is read from this clock (tests swap in a fake one): see now().
        self.clock: Callable[[], float] = time.monotonic
        # Which routers are still there: a gone one's requests are ended (worker.routers).
        # Through a weak proxy: a cycle would keep a dropped worker and its sockets alive.
        me = weakref.proxy(self)
        self.routers = RouterWatch(self.outbox.link_drops, self.outbox.watch,
                                   clock=lambda: me.clock())
        self.next_router_check = 0.0
        self.stopped = False
        self.num_failed = 0
        self.num_transfer_failures = 0
        self.num_orphaned = 0
        kernels = kernel_report(model, e)
        if e.device == "cpu" and e.cpu_kernels and cpu_kernel_build().failed:
            logger.error("%s worker %s: %s", self.role, config.worker_id, kernels)
        logger.info(
            "%s worker %s: %s, %s on %s (%s attention), %d KV pages of %d tokens "
            "(KV %s, %.0f bytes/token), %s, inbox %s",
            self.role, config.worker_id, e.model, self.dtype, e.device,
            type(model.attn_backend).__name__, num_pages - 1, e.page_size,
            e.kv_cache_dtype, layout.bytes_per_token, kernels, config.addr,
        )

    def _rejoin(self, i: int) -> tuple[str, WorkerReady] | None:
        """On the heartbeat thread: register with router ``i`` of ``router_urls`` again; when
        it had forgotten us (restarted), return its inbox and the ready announcement for the
        heartbeat to send there (worker.heartbeat). Replies need no change: each request
        names its router's inbox."""
        c = self.config
        url = c.router_urls[i]
        inbox = rejoin_router(url, self.role, c.worker_id, c.addr, c.security.api_key)
        if inbox is None:
            return None
        logger.warning("router %s did not know this worker (restarted?): rejoined", url)
        return inbox, WorkerReady(c.worker_id, self.role, c.addr)

    def _capture_decode_graphs(self, model: torch.nn.Module) -> DecodeGraphRunner | None:
        """CUDA graphs for decode steps of up to ``max_running`` rows (at most
        ``MAX_GRAPH_BATCH``: larger steps run eagerly, where launches are a small share), on
        CUDA workers that decode (colocated, decode) unless ``--disable-cuda-graph``; else
        None."""
        e = self.config.engine
        if (
            not e.cuda_graph
            or not self.decodes
            or torch.device(e.device).type != "cuda"
            or not model.attn_backend.supports_cuda_graphs
        ):
            return None
        largest = min(e.max_running, MAX_GRAPH_BATCH)
        sizes = tuple(n for n in DEFAULT_BATCH_SIZES if n < largest)
        return DecodeGraphRunner(model, self.pool, sizes + (largest,))

    # ---- main loop ----------------------------------------------------------------------------

    def serve_forever(self, server_addrs: list[str] | None = None) -> None:
        """Serve until SIGTERM or ``Shutdown``, reporting to the routers whose inboxes are
        ``server_addrs`` (those of ``config.router_urls``, in order, as registration gave them;
        default: ``config.server_addr``)."""
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopped", True))
        c = self.config
        server_addrs = list(server_addrs or [c.server_addr])
        for addr in server_addrs:
            self.send(addr, WorkerReady(c.worker_id, self.role, c.addr))
        beat = Heartbeat(
            self.ctx, server_addrs, self.stats, configure=self._curve_client,
            rejoin=self._rejoin if c.router_urls else None,
        )
        beat.start()
        try:
            while not self.stopped:
                self.run_once(idle_wait_ms=20)
        finally:
            beat.stop()
            beat.join()
            if self.auth is not None:
                self.auth.stop()
            self.grammars.service.shutdown()
            self.core.close()
            # Backend threads (mooncake/nixl writers, nixl's progress thread) stop before the
            # interpreter exits: a nixl thread still inside UCX at exit crashed the process.
            self.close_kv_transfer()
            self.inbox.close()
            self.outbox.close()
            self.ctx.term()

    def close_kv_transfer(self) -> None:
        """Release this worker's KV transfer backend (threads, registrations, mappings); called
        once when :meth:`serve_forever` ends. Nothing by default."""

    def run_once(self, idle_wait_ms: int = 0) -> None:
        """Drain the inbox, expire timed-out requests, run one step if there is work."""
        # Work that cannot be scheduled (waiting for pages) must not spin the core the model uses;
        # the poll still returns at once when a message arrives.
        busy = self.has_work() and self.scheduler.last_num_scheduled > 0
        wait_ms = 0 if busy else COMPILE_POLL_MS if len(self.grammars) else idle_wait_ms
        if self.inbox.poll(wait_ms):
            for _ in range(MAX_MESSAGES_PER_STEP):
                item = self.inbox.recv()
                if item is None:
                    break
                self.dispatch(*item)
        for done in self.grammars.poll():
            self.on_grammar_done(done)
        now = self.now()
        self.check_timeouts(now)
        if now >= self.next_router_check:
            self.next_router_check = now + CHECK_S
            self.check_routers(now)
        if self.scheduler.has_work:
            self.on_step_outputs(self.core.step())

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def now(self) -> float:
        """Seconds on :attr:`clock` (``time.monotonic`` unless a test replaced it)."""
        return self.clock()

    def dispatch(self, msg: Message, frames: Frames | list) -> None:
        try:
            if isinstance(msg, GenerateTask):
                if self.routers.dropped(msg.reply_addr):
                    # A router restarted at the same inbox: its predecessor's requests go first.
                    self.end_requests_of(msg.reply_addr, "closed its link")
                self.routers.heard(msg.reply_addr)
                self.on_generate(msg)
            elif isinstance(msg, AbortTask):
                self.on_abort(msg.rid)
            elif isinstance(msg, RouterBeat):
                self.routers.heard(msg.reply_addr, msg.dead_after_s)
            elif isinstance(msg, StatsQuery):
                self.routers.heard(msg.reply_addr)
                self.send(msg.reply_addr, self.stats(msg.query_id))
            elif isinstance(msg, FlushCache):
                freed = self.scheduler.cache.flush()
                logger.info("%s worker %s: flushed %d cached pages", self.role,
                            self.config.worker_id, freed)
                self.send(msg.reply_addr, self.stats(msg.query_id))
            elif isinstance(msg, Shutdown):
                self.stopped = True
            else:
                self.on_peer_message(msg, frames)
        except PeerUnreachable as exc:
            logger.warning("%s: %s", type(msg).__name__, exc)
        except IllegalTransition:
            # A message its KV transfer session cannot take (a duplicate task or bootstrap):
            # a bug in a peer or here. Loud, but the worker serves the other requests on.
            logger.exception("%s for %s dropped", type(msg).__name__, getattr(msg, "rid", "?"))

    # ---- role hooks ---------------------------------------------------------------------------

    def on_generate(self, task: GenerateTask) -> None:
        raise NotImplementedError

    def on_abort(self, rid: str) -> None:
        raise NotImplementedError

    def on_peer_message(self, msg: Message, frames: Frames | list) -> None:
        logger.warning("%s worker ignores %s", self.role, type(msg).__name__)

    def on_step_outputs(self, outputs: list[StepOutput]) -> None:
        raise NotImplementedError

    def on_grammar_done(self, done: CompileDone) -> None:
        """A request's constraint compiled (``done.req.grammar`` set) or failed (``done.error``)."""
        raise NotImplementedError

    def check_timeouts(self, now: float) -> None:
        pass

    def held_requests(self) -> dict[str, str]:
        """``rid -> reply_addr`` of every request this worker holds anything for (queued,
        running, compiling, in a KV handoff). Roles add what they hold outside the scheduler."""
        return {r.rid: r.reply_addr for r in (*self.scheduler.waiting, *self.scheduler.running)}

    # ---- routers that went away (worker.routers) ----------------------------------------------

    def check_routers(self, now: float) -> None:
        """End the requests of every router that is gone (link closed, or silent past its
        ``dead_after_s``), freeing their pages."""
        held = self.held_requests()
        for addr, why in self.routers.gone(now, set(held.values())):
            self.end_requests_of(addr, why, held)

    def end_requests_of(self, addr: str, why: str, held: dict[str, str] | None = None) -> None:
        """Abort every request of the router at ``addr`` (its pages freed on this worker; the
        router, if it is only cut off, gets a 503 for each should the link come back)."""
        held = self.held_requests() if held is None else held
        rids = [rid for rid, reply in held.items() if reply == addr]
        if not rids:
            return
        logger.warning("%s worker %s: router at %s %s: ending its %d requests", self.role,
                       self.config.worker_id, addr, why, len(rids))
        for rid in rids:
            self.on_abort(rid)
            self.num_orphaned += 1
            try:
                self.send(addr, RequestError(rid, f"the router at {addr} {why}: the "
                                                  f"{self.role} worker ended the request", 503))
            except PeerUnreachable:
                pass

    # ---- helpers ------------------------------------------------------------------------------

    def new_req(self, task: GenerateTask) -> Req:
        """The scheduler's request for ``task``. Its output is capped at what this worker's KV
        pool holds after the prompt: a sequence that outgrew the pool could never be re-admitted
        once retracted and would wedge the queue behind it. It then ends with ``length``, as at
        the model's context (only a pool smaller than the context can hit this)."""
        sampling = task.sampling
        room = (self.pool.allocator.num_pages - 1) * self.pool.page_size - len(task.input_ids)
        if sampling.max_new_tokens > room:
            sampling = msgspec.structs.replace(sampling, max_new_tokens=max(room, 1))
        return Req(
            rid=task.rid,
            input_ids=list(task.input_ids),
            sampling=sampling,
            reply_addr=task.reply_addr,
            cache_namespace=task.cache_namespace,
        )

    def check_fits(self, task: GenerateTask) -> str | None:
        """An error message if the prompt can never fit this worker's pool or context."""
        n = len(task.input_ids)
        if n == 0:
            return "prompt is empty"
        if n >= self.model_config.context_len:
            return f"prompt of {n} tokens exceeds the model context of {self.model_config.context_len}"
        if not self.scheduler.fits_pool(n + 1):
            cap = (self.pool.allocator.num_pages - 1) * self.pool.page_size
            return f"prompt of {n} tokens does not fit the KV pool ({cap} tokens)"
        return None

    def _curve_client(self, sock: zmq.Socket) -> None:
        if self.curve is not None:
            from splitserve.ipc.security import apply_curve_client

            apply_curve_client(sock, self.curve)

    def send(self, addr: str, msg: Message, frames: list | tuple = ()) -> None:
        self.outbox.send(addr, msg, frames)

    def fail(self, rid: str, reply_addr: str, message: str, code: int = 500) -> None:
        logger.info("request %s failed: %s", rid, message)
        self.num_failed += 1
        if "KV transfer" in message or "refused by prefill" in message:
            self.num_transfer_failures += 1
        try:
            self.send(reply_addr, RequestError(rid, message, code))
        except PeerUnreachable as exc:
            logger.warning("could not report failure of %s: %s", rid, exc)

    def emit(self, outputs: list[tuple[str, TokenOutput]]) -> None:
        """Send token outputs, one :class:`TokenBatch` per server address."""
        by_addr: dict[str, list[TokenOutput]] = {}
        for addr, out in outputs:
            by_addr.setdefault(addr, []).append(out)
        for addr, outs in by_addr.items():
            try:
                self.send(addr, TokenBatch(outs))
            except PeerUnreachable as exc:
                logger.warning("dropping %d outputs: %s", len(outs), exc)

    def emit_decoded(self, outputs: list[StepOutput]) -> None:
        """Send each output's new tokens (those not yet emitted, jump-forward ones included)."""
        emitted = []
        for out in outputs:
            req = out.req
            emitted.append((req.reply_addr, self.token_output(req, req.emitted_len)))
            req.emitted_len = len(req.output_ids)
        self.emit(emitted)

    def token_output(self, req: Req, index: int) -> TokenOutput:
        """Output of ``req``'s tokens from output position ``index`` to the end."""
        wants_prompt_top = req.sampling.wants_prompt_logprobs and req.sampling.top_logprobs > 0
        return TokenOutput(
            rid=req.rid,
            index=index,
            token_ids=req.output_ids[index:],
            logprobs=req.output_logprobs[index:],
            finish_reason=req.finish_reason,
            prompt_len=req.prompt_len,
            cached_len=req.cached_len,
            # The first output carries them: from the prefill worker when disaggregated.
            prompt_logprobs=(
                req.prompt_logprobs if index == 0 and req.sampling.wants_prompt_logprobs else None
            ),
            top_ids=req.output_top_ids[index:],
            top_logprobs=req.output_top_logprobs[index:],
            prompt_top_ids=req.prompt_top_ids if index == 0 and wants_prompt_top else None,
            prompt_top_logprobs=req.prompt_top_logprobs if index == 0 and wants_prompt_top else None,
        )

    def num_transferring(self) -> int:
        return 0

    def stats(self, query_id: int = 0) -> WorkerStats:
        alloc = self.pool.allocator
        model = self.runner.model
        cache = self.scheduler.cache.stats()
        return WorkerStats(
            query_id=query_id,
            worker_id=self.config.worker_id,
            role=self.role,
            pages_total=alloc.num_pages - 1,
            pages_used=alloc.num_used,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_transferring=self.num_transferring(),
            cache_pages=cache.cached_pages,
            cache_evictable_pages=cache.evictable_pages,
            cache_hit_tokens=cache.hit_tokens,
            cache_prompt_tokens=cache.prompt_tokens,
            cache_evicted_pages=cache.evicted_pages,
            transfer_failures=self.num_transfer_failures,
            requests_failed=self.num_failed,
            requests_orphaned=self.num_orphaned,
            kv_pool_bytes=self.pool.buffer.numel() * self.pool.buffer.element_size(),
            kv_cache_dtype=self.pool.layout.kv_cache_dtype,
            decode_cache_bytes=model.attn_backend.cache_bytes(),
            weight_bytes=model.weight_bytes(),
            kernel_plan=kernel_report(model, self.config.engine),
            spec_draft_tokens=self.scheduler.num_draft_tokens,
            spec_accepted_tokens=self.scheduler.num_accepted_tokens,
            node=self.config.node or socket.gethostname(),
        )
