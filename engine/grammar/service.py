"""Compiles constraints off the scheduler thread, caches them, and walks the backend chain.

The chain for each constraint comes from ``splitserve.constraints.chain.plan_chain``: sound
backends first (those that enforce every keyword of a JSON schema, from the measured
``constraints.schema_limits``), then, unless ``CompileOptions.strict``, the others; the grammar
that compiles records what its backend ignores (``CompiledGrammar.ignored``).

A scheduler calls ``submit(kind, text, options)`` when a constrained request arrives and keeps the
returned future with the request. Each step it checks ``future.done()``: requests whose grammar
is still compiling simply stay waiting, so they never block the rest of the batch. When done,
``future.result()`` is the ``CompiledGrammar`` (make one matcher per request from it) or raises
``GrammarError`` (fail only that request, HTTP 400) or ``CompileBusy`` (503: the compile queue
is full, or no compile process could be started: ``CompileUnavailable``).

With a :class:`~splitserve.engine.grammar.compile_pool.CompilePool` the compiles run in child
processes that are killed at their deadline (a thread cannot be stopped; xgrammar spends
minutes on some schemas); without one, on threads, as before. Either way a compile's deadline
counts from when it starts, and a constraint that timed out fails at once with the same message
for ``remember_timeouts_s`` (a client retrying a pathological schema does not occupy a compile
slot again). A compile whose requests all went (:meth:`GrammarService.release`) is dropped if it
has not started.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from splitserve.constraints.chain import ChainStep, plan_chain
from splitserve.engine.grammar.base import (
    GRAMMAR_KINDS,
    BaseGrammarBackend,
    CompiledGrammar,
    GrammarError,
    GrammarKind,
)
from splitserve.engine.grammar.compile_pool import CompileBusy, CompilePool
from splitserve.engine.grammar.demote import demote_thread
from splitserve.engine.grammar.options import DEFAULT_OPTIONS, CompileOptions

logger = logging.getLogger(__name__)

CacheKey = tuple[str, str, CompileOptions]


class _Attempt:
    """One request's walk down the backend chain; collects each backend's failure reason."""

    def __init__(
        self,
        key: CacheKey,
        result: Future[CompiledGrammar],
        steps: Sequence[ChainStep],
        source: str,
    ) -> None:
        self.key = key
        self.result = result
        self.steps = list(steps)
        self.source = source  # what the backends compile (``ChainPlan.source``)
        self.errors: list[str] = []
        self.lock = threading.RLock()  # re-entered when cancelling runs the done callback
        self.backend_index = 0
        self.job: Future | None = None  # the running step's compile (thread or process)


class GrammarService:
    """Thread-pool compilation with a (kind, text, options) cache, a timeout and the backend chain.

    Args:
        backends: the configured order (default backend first); ``chain.plan_chain`` reorders
            them per constraint, and a constraint that one cannot compile (error or timeout) is
            tried on the next.
        timeout_s: seconds each backend gets for one compile, from when it starts. On a
            thread, a timed-out compile cannot be killed (its late result is dropped); with
            ``pool`` its process is killed. Then the next backend is tried.
        num_threads: threads that compile (without ``pool``) or rebuild shipped grammars.
        max_cache_entries: compiled grammars kept (least recently used evicted); failures are
            cached too, so a bad schema sent repeatedly costs one compile.
        max_cache_bytes: the cached grammars' summed ``CompiledGrammar.size_bytes`` estimate
            stays at most this (bytes; least recently used evicted, a grammar larger than it
            alone is not kept); 0: no byte bound. Requests holding an evicted grammar keep it
            until they end.
        pool: compile in these child processes (its own deadline replaces ``timeout_s``).
        remember_timeouts_s: how long a constraint that timed out on every backend it was
            tried on keeps failing at once (0: not remembered).
    """

    def __init__(
        self,
        backends: Sequence[BaseGrammarBackend],
        timeout_s: float = 30.0,
        num_threads: int = 2,
        max_cache_entries: int = 1024,
        pool: CompilePool | None = None,
        remember_timeouts_s: float = 600.0,
        max_cache_bytes: int = 0,
    ) -> None:
        if not backends:
            raise ValueError("GrammarService needs at least one backend")
        self.backends = list(backends)
        self._by_name = {b.name: b for b in self.backends}
        self.timeout_s = pool.timeout_s if pool is not None else timeout_s
        self.compile_pool = pool
        self.remember_timeouts_s = remember_timeouts_s
        self._timed_out: dict[CacheKey, float] = {}  # key -> when it may be compiled again
        self._attempts: dict[CacheKey, _Attempt] = {}  # compiles in progress
        self._waiters: dict[CacheKey, int] = {}  # requests waiting on each of them
        self.max_cache_entries = max_cache_entries
        self.max_cache_bytes = max_cache_bytes
        self._sizes: dict[CacheKey, int] = {}  # compiled grammars in the cache -> size_bytes
        self._cached_bytes = 0
        self.evicted_for_bytes = 0  # grammars evicted by the byte bound (a counter for tests)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[CacheKey, Future[CompiledGrammar]] = OrderedDict()
        self._cache_lock = threading.Lock()

    def submit(
        self, kind: GrammarKind, text: str, options: CompileOptions = DEFAULT_OPTIONS
    ) -> Future[CompiledGrammar]:
        """Start compiling (or find the cached compile of) a constraint; never blocks on it.

        Args:
            kind: one of ``GRAMMAR_KINDS``.
            text: the constraint source (for ``json_object`` it is ignored).
            options: whitespace and strictness (``options.CompileOptions``).

        Returns:
            A future that resolves to a ``CompiledGrammar`` or fails with ``GrammarError`` (under
            ``options.strict``, also when no backend enforces the whole schema: the message names
            each keyword and its JSON pointer). The same (kind, text, options) returns the same
            future, so its result is the same object.
        """
        if kind == "json_object":
            text = ""  # one cache entry, whatever the caller passed
        key = (kind, text, options)
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None and self._timed_out.get(key, float("inf")) <= time.monotonic():
                del self._cache[key], self._timed_out[key]  # time to try it again
                cached = None
            if cached is not None:
                self._cache.move_to_end(key)
                if not cached.done():
                    self._waiters[key] = self._waiters.get(key, 0) + 1
                return cached
            result: Future[CompiledGrammar] = Future()
            self._cache[key] = result
            self._waiters[key] = 1
            while len(self._cache) > self.max_cache_entries:
                evicted, _ = self._cache.popitem(last=False)
                self._timed_out.pop(evicted, None)
                self._cached_bytes -= self._sizes.pop(evicted, 0)
        if kind not in GRAMMAR_KINDS:
            result.set_exception(
                GrammarError(f"unknown constraint kind {kind!r}; expected one of {GRAMMAR_KINDS}")
            )
            return result
        plan = plan_chain(kind, text, [b.name for b in self.backends], strict=options.strict)
        if not plan.steps:
            result.set_exception(GrammarError(_unenforceable_message(plan.ignored_by_all)))
            return result
        attempt = _Attempt(key, result, plan.steps, plan.source)
        with self._cache_lock:
            self._attempts[key] = attempt
        result.add_done_callback(lambda _: self._forget_attempt(key, attempt))
        self._try_next_backend(attempt)
        return result

    def release(
        self, kind: GrammarKind, text: str, options: CompileOptions = DEFAULT_OPTIONS
    ) -> bool:
        """One request waiting on this constraint went; when none waits and its compile has
        not started, the compile is dropped (and not cached).

        Returns:
            Whether a queued compile was dropped.
        """
        key = (kind, "" if kind == "json_object" else text, options)
        with self._cache_lock:
            left = self._waiters.get(key, 0) - 1
            if left > 0:
                self._waiters[key] = left
                return False
            self._waiters.pop(key, None)
            attempt = self._attempts.get(key)
        if attempt is None:
            return False
        with attempt.lock:
            job, index = attempt.job, attempt.backend_index
            if job is None or attempt.result.done():
                return False
            attempt.backend_index = len(attempt.steps)  # its callback must not try the next
            dropped = (self.compile_pool.cancel(job) if self.compile_pool is not None
                       else job.cancel())
            if not dropped:  # already running: it goes on
                attempt.backend_index = index
                return False
        with self._cache_lock:
            if self._cache.get(key) is attempt.result:
                del self._cache[key]
        attempt.result.set_exception(GrammarError("compile cancelled: its requests went"))
        return True

    def _forget_attempt(self, key: CacheKey, attempt: _Attempt) -> None:
        with self._cache_lock:
            if self._attempts.get(key) is attempt:
                del self._attempts[key]
                self._waiters.pop(key, None)

    def compile(
        self, kind: GrammarKind, text: str, options: CompileOptions = DEFAULT_OPTIONS
    ) -> CompiledGrammar:
        """Blocking ``submit(...).result()``, for tests and tools (not the scheduler loop).

        Raises:
            GrammarError: if no backend can compile the constraint in time.
        """
        return self.submit(kind, text, options).result()

    def cached_bytes(self) -> int:
        """Returns: the summed ``size_bytes`` estimate of the compiled grammars cached now."""
        with self._cache_lock:
            return self._cached_bytes

    def _account(self, key: CacheKey, future: Future[CompiledGrammar], size: int) -> None:
        """Count a compiled grammar's ``size`` in the cache, then evict the least recently used
        compiled grammars until the cache is within ``max_cache_bytes`` (a grammar over the
        bound by itself is not kept, and evicts nothing)."""
        with self._cache_lock:
            if self._cache.get(key) is not future:
                return  # evicted (or replaced) while it compiled
            if self.max_cache_bytes and size > self.max_cache_bytes:
                del self._cache[key]  # alone over the bound: served, not kept
                self.evicted_for_bytes += 1
                return
            self._cached_bytes += size - self._sizes.get(key, 0)
            self._sizes[key] = size
            if not self.max_cache_bytes:
                return
            for old in [k for k in self._cache if k in self._sizes and k != key]:
                if self._cached_bytes <= self.max_cache_bytes:
                    break
                del self._cache[old]
                self._cached_bytes -= self._sizes.pop(old)
                self.evicted_for_bytes += 1

    def is_cached(
        self, kind: GrammarKind, text: str, options: CompileOptions = DEFAULT_OPTIONS
    ) -> bool:
        """Returns: True if the constraint has a finished, successful compile in the cache."""
        with self._cache_lock:
            future = self._cache.get((kind, "" if kind == "json_object" else text, options))
        return future is not None and future.done() and future.exception() is None

    def shutdown(self) -> None:
        """Stop accepting work; running compiles finish in the background (in processes:
        killed)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.compile_pool is not None:
            self.compile_pool.shutdown()
        with self._cache_lock:
            attempts = list(self._attempts.values())
        for attempt in attempts:  # nothing is left to finish them
            with attempt.lock:
                attempt.backend_index = len(attempt.steps)
                if not attempt.result.done():
                    attempt.result.set_exception(GrammarError("the grammar service shut down"))

    def _try_next_backend(self, attempt: _Attempt) -> None:
        """Run the chain's next backend on the pool, with a timer for its timeout."""
        if attempt.backend_index >= len(attempt.steps):
            self._fail(attempt)
            return
        step = attempt.steps[attempt.backend_index]
        backend = self._by_name[step.backend]
        index = attempt.backend_index
        kind, _, options = attempt.key
        source = step.source or attempt.source
        if self.compile_pool is not None:
            try:
                job = self.compile_pool.submit(backend.name, kind, source, options)
            except CompileBusy as exc:
                self._refuse_busy(attempt, exc)
                return
            attempt.job = job
            job.add_done_callback(lambda done: self._rebuild(attempt, index, backend, done))
            return
        timer = threading.Timer(self.timeout_s, self._on_timeout, args=(attempt, index, backend))
        timer.daemon = True

        def run() -> CompiledGrammar:
            timer.start()  # the deadline counts from the compile's start, not its queueing
            return backend.compile(kind, source, options)  # type: ignore[arg-type]

        job = self._pool.submit(run)
        attempt.job = job
        job.add_done_callback(lambda done: self._on_done(attempt, index, backend, done, timer))

    def _rebuild(
        self, attempt: _Attempt, index: int, backend: BaseGrammarBackend, job: Future
    ) -> None:
        """Rebuild a shipped grammar on a thread (not the pool's thread, which waits on the
        next child). One the child compiled for longer than the pool's ``long_after_s`` is
        rebuilt on a thread of its own at nice 19 (``engine.grammar.demote``): rebuilding
        costs about what compiling did, and it must not take the model's CPU either."""
        assert self.compile_pool is not None
        shipped = None if job.cancelled() or job.exception() is not None else job.result()
        if shipped is not None and shipped.compile_s >= self.compile_pool.long_after_s:
            threading.Thread(target=self._on_shipped_demoted, args=(attempt, index, backend, job),
                             daemon=True, name="grammar-rebuild-long").start()
            return
        try:
            self._pool.submit(self._on_shipped, attempt, index, backend, job)
        except RuntimeError:  # shut down: shutdown() failed the attempt
            pass

    def _on_shipped_demoted(
        self, attempt: _Attempt, index: int, backend: BaseGrammarBackend, job: Future
    ) -> None:
        # nice 19, not SCHED_IDLE: it must end on a busy host. This thread only (its id).
        demote_thread(threading.get_native_id(), idle_class=False)
        self._on_shipped(attempt, index, backend, job)

    def _on_shipped(
        self, attempt: _Attempt, index: int, backend: BaseGrammarBackend, job: Future
    ) -> None:
        """A child's compile ended: rebuild its grammar here, or record why it failed."""
        if job.cancelled():
            return  # released (``release`` failed the attempt)
        done: Future[CompiledGrammar] = Future()
        error = job.exception()
        if error is None:
            kind, _, options = attempt.key
            source = attempt.steps[index].source or attempt.source
            try:
                done.set_result(backend.restore(kind, source, options,  # type: ignore[arg-type]
                                                job.result().payload))
            except Exception as exc:  # noqa: BLE001 -- handed to the request, whatever it is
                done.set_exception(exc)
        else:
            done.set_exception(error)
        self._on_done(attempt, index, backend, done, None)

    def _refuse_busy(self, attempt: _Attempt, exc: CompileBusy) -> None:
        with self._cache_lock:
            if self._cache.get(attempt.key) is attempt.result:
                del self._cache[attempt.key]
        attempt.result.set_exception(exc)

    def _on_done(
        self,
        attempt: _Attempt,
        index: int,
        backend: BaseGrammarBackend,
        job: Future[CompiledGrammar],
        timer: threading.Timer | None,
    ) -> None:
        if timer is not None:
            timer.cancel()
        with attempt.lock:
            if attempt.backend_index != index or attempt.result.done():
                return  # this backend already timed out; its late result is dropped
            error = GrammarError("compile cancelled") if job.cancelled() else job.exception()
            if isinstance(error, CompileBusy):
                # Ours (no compile process could start), not the constraint's: no next backend.
                attempt.backend_index = len(attempt.steps)
                refused: CompileBusy | None = error
            elif error is None:
                compiled = job.result()
                ignored = attempt.steps[index].ignored
                if ignored:
                    compiled.ignored = ignored
                    logger.warning("%s compiled %s with keywords not enforced: %s",
                                   backend.name, kind_of(attempt), "; ".join(ignored))
                try:
                    size = compiled.size_bytes()
                except Exception:  # an estimate must not fail the request
                    logger.exception("size of a %s grammar", backend.name)
                    size = 0
                self._account(attempt.key, attempt.result, size)
                attempt.result.set_result(compiled)
                return
            else:
                attempt.errors.append(f"{backend.name}: {_reason(error)}")
                attempt.backend_index += 1
                refused = None
        if refused is not None:
            self._refuse_busy(attempt, refused)
            return
        self._try_next_backend(attempt)

    def _on_timeout(self, attempt: _Attempt, index: int, backend: BaseGrammarBackend) -> None:
        with attempt.lock:
            if attempt.backend_index != index or attempt.result.done():
                return
            attempt.errors.append(f"{backend.name}: compile timed out after {self.timeout_s:g}s")
            attempt.backend_index += 1
        self._try_next_backend(attempt)

    def _fail(self, attempt: _Attempt) -> None:
        timed_out = any("timed out" in e for e in attempt.errors)
        kind = kind_of(attempt)
        message = f"cannot compile {kind} constraint: " + "; ".join(attempt.errors)
        if timed_out:  # a timeout may pass on a quieter machine: remembered for a while only
            with self._cache_lock:
                if self._cache.get(attempt.key) is attempt.result:
                    if self.remember_timeouts_s > 0:
                        self._timed_out[attempt.key] = time.monotonic() + self.remember_timeouts_s
                        message += (f" (remembered: the same constraint fails at once for "
                                    f"{self.remember_timeouts_s:g}s)")
                    else:
                        del self._cache[attempt.key]
        attempt.result.set_exception(GrammarError(message))


def kind_of(attempt: _Attempt) -> str:
    """Returns: the attempt's constraint kind (for log lines)."""
    return attempt.key[0]


def _unenforceable_message(ignored_by_all: dict[str, tuple[str, ...]]) -> str:
    """Returns: the strict-mode refusal, naming what each backend would not enforce."""
    parts = [f"{name} does not enforce {'; '.join(ignored)}"
             for name, ignored in ignored_by_all.items() if ignored]
    return "no grammar backend enforces every keyword of this schema: " + " | ".join(parts)


def _reason(error: BaseException) -> str:
    """Returns: the message of a backend failure; unexpected exceptions keep their type name."""
    if isinstance(error, GrammarError):
        return str(error)
    return f"{type(error).__name__}: {error}"
