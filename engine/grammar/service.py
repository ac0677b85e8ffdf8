"""Compiles constraints off the scheduler thread, caches them, and walks the backend chain.

The chain for each constraint comes from ``splitserve.constraints.chain.plan_chain``: sound
backends first (those that enforce every keyword of a JSON schema, from the measured
``constraints.schema_limits``), then, unless ``CompileOptions.strict``, the others; the grammar
that compiles records what its backend ignores (``CompiledGrammar.ignored``).

A scheduler calls ``submit(kind, text, options)`` when a constrained request arrives and keeps the
returned future with the request. Each step it checks ``future.done()``: requests whose grammar
is still compiling simply stay waiting, so they never block the rest of the batch. When done,
``future.result()`` is the ``CompiledGrammar`` (make one matcher per request from it) or raises
``GrammarError`` (fail only that request, HTTP 400).
"""

from __future__ import annotations

import logging
import threading
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
        self.lock = threading.Lock()
        self.backend_index = 0


class GrammarService:
    """Thread-pool compilation with a (kind, text, options) cache, a timeout and the backend chain.

    Args:
        backends: the configured order (default backend first); ``chain.plan_chain`` reorders
            them per constraint, and a constraint that one cannot compile (error or timeout) is
            tried on the next.
        timeout_s: seconds each backend gets for one compile. A timed-out compile thread cannot
            be killed; its late result is dropped and the next backend is tried.
        num_threads: compile threads (xgrammar and outlines-core release the GIL while compiling).
        max_cache_entries: compiled grammars kept (least recently used evicted); failures are
            cached too, so a bad schema sent repeatedly costs one compile. Timeouts are not cached.
    """

    def __init__(
        self,
        backends: Sequence[BaseGrammarBackend],
        timeout_s: float = 30.0,
        num_threads: int = 2,
        max_cache_entries: int = 1024,
    ) -> None:
        if not backends:
            raise ValueError("GrammarService needs at least one backend")
        self.backends = list(backends)
        self._by_name = {b.name: b for b in self.backends}
        self.timeout_s = timeout_s
        self.max_cache_entries = max_cache_entries
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
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            result: Future[CompiledGrammar] = Future()
            self._cache[key] = result
            while len(self._cache) > self.max_cache_entries:
                self._cache.popitem(last=False)
        if kind not in GRAMMAR_KINDS:
            result.set_exception(
                GrammarError(f"unknown constraint kind {kind!r}; expected one of {GRAMMAR_KINDS}")
            )
            return result
        plan = plan_chain(kind, text, [b.name for b in self.backends], strict=options.strict)
        if not plan.steps:
            result.set_exception(GrammarError(_unenforceable_message(plan.ignored_by_all)))
            return result
        self._try_next_backend(_Attempt(key, result, plan.steps, plan.source))
        return result

    def compile(
        self, kind: GrammarKind, text: str, options: CompileOptions = DEFAULT_OPTIONS
    ) -> CompiledGrammar:
        """Blocking ``submit(...).result()``, for tests and tools (not the scheduler loop).

        Raises:
            GrammarError: if no backend can compile the constraint in time.
        """
        return self.submit(kind, text, options).result()

    def is_cached(
        self, kind: GrammarKind, text: str, options: CompileOptions = DEFAULT_OPTIONS
    ) -> bool:
        """Returns: True if the constraint has a finished, successful compile in the cache."""
        with self._cache_lock:
            future = self._cache.get((kind, "" if kind == "json_object" else text, options))
        return future is not None and future.done() and future.exception() is None

    def shutdown(self) -> None:
        """Stop accepting work; running compiles finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _try_next_backend(self, attempt: _Attempt) -> None:
        """Run the chain's next backend on the pool, with a timer for its timeout."""
        if attempt.backend_index >= len(attempt.steps):
            self._fail(attempt)
            return
        step = attempt.steps[attempt.backend_index]
        backend = self._by_name[step.backend]
        index = attempt.backend_index
        kind, _, options = attempt.key
        job = self._pool.submit(
            backend.compile, kind, step.source or attempt.source, options  # type: ignore[arg-type]
        )
        timer = threading.Timer(self.timeout_s, self._on_timeout, args=(attempt, index, backend))
        timer.daemon = True
        timer.start()
        job.add_done_callback(lambda done: self._on_done(attempt, index, backend, done, timer))

    def _on_done(
        self,
        attempt: _Attempt,
        index: int,
        backend: BaseGrammarBackend,
        job: Future[CompiledGrammar],
        timer: threading.Timer,
    ) -> None:
        timer.cancel()
        with attempt.lock:
            if attempt.backend_index != index or attempt.result.done():
                return  # this backend already timed out; its late result is dropped
            error = GrammarError("compile cancelled") if job.cancelled() else job.exception()
            if error is None:
                compiled = job.result()
                ignored = attempt.steps[index].ignored
                if ignored:
                    compiled.ignored = ignored
                    logger.warning("%s compiled %s with keywords not enforced: %s",
                                   backend.name, kind_of(attempt), "; ".join(ignored))
                attempt.result.set_result(compiled)
                return
            attempt.errors.append(f"{backend.name}: {_reason(error)}")
            attempt.backend_index += 1
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
        if timed_out:  # a timeout may pass on a quieter machine; let a later request retry
            with self._cache_lock:
                if self._cache.get(attempt.key) is attempt.result:
                    del self._cache[attempt.key]
        kind = kind_of(attempt)
        message = f"cannot compile {kind} constraint: " + "; ".join(attempt.errors)
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
