"""Grammar compiles in child processes, where a compile past its deadline can be stopped.

A compile thread cannot be killed: xgrammar spends minutes on some real schemas, inside C++
that never returns to Python, and a thread that runs it holds its slot for as long. Here each
compile runs in one of a few child processes (the ``spawn`` context: no copy of the worker's
threads or CUDA state; started when the first compile arrives, each at ``nice`` +10 so that it
yields the CPU to the model). The design follows browsers' and llama.cpp's isolation of work
that cannot be interrupted: run it where it can be killed.

- The deadline counts from when the child is handed the compile, not from when it was queued;
  past it the child is killed (SIGKILL) and a fresh one replaces it.
- At most ``max_queued`` compiles wait; one more is refused at once (:class:`CompileBusy`, which
  the worker turns into 503 + ``Retry-After``), not queued.
- A queued compile whose requests all went is removed from the queue (:meth:`CompilePool.cancel`).
- The child sends back what the backend can ship across a process boundary
  (``BaseGrammarBackend.export``): outlines-core's ``Index`` (picklable). For llguidance (its
  matcher cannot be shipped; it builds its parser lazily, so compiling again costs ms) and
  xgrammar (its ``serialize_json`` is 1 to 60 times the grammar's memory as JSON text, and took
  GBs of transient memory and longer than the compile to write and read back) the child only
  proves that the compile finishes in time and the worker compiles it again
  (``BaseGrammarBackend.restore``).

A child that does not finish building its backends within ``start_timeout_s`` is killed and
the compiles waiting for it fail with :class:`CompileUnavailable` (a 503 with ``Retry-After``, as
a full queue; a new child is started for the next): no compile waits on a child that never
became ready. A child that fails in any way while it holds a compile fails that
compile and is replaced; the slot's thread never dies with a compile in its hands.

Test hooks: ``slow_marker``/``slow_s`` make a child sleep ``slow_s`` before compiling a
constraint whose text contains the marker (a compile that only a kill ends), set through
``EngineConfig.grammar_test_slow`` -- never from the environment; ``start_delay_s`` makes a
child sleep before it builds its backends (a start that only the start deadline ends).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from splitserve.engine.grammar.base import GrammarError
from splitserve.engine.grammar.options import CompileOptions

logger = logging.getLogger(__name__)

CHILD_NICE = 10
PARENT_POLL_S = 1.0  # how often a child checks that its worker is still there
# A child's start (imports, then every backend built for the model's vocabulary) took ~10 s on
# a quiet 2-core Zen 3 with Qwen2.5's 151k tokens and ~65 s beside a test run; past this bound
# it is killed and the compiles waiting for it fail.
START_TIMEOUT_S = 180.0
SLOW_START_S = 30.0  # a start slower than this is logged (with how long it took)


class CompileBusy(RuntimeError):
    """The compile queue is full: the request should be retried later (HTTP 503)."""


class CompileUnavailable(CompileBusy):
    """No compile process could be started for this compile (it died or was not ready within
    ``start_timeout_s``): our fault, not the constraint's, so a 503 to retry like
    :class:`CompileBusy`, not a 400."""


class CompileTimeout(GrammarError):
    """A compile ran past its deadline and its process was killed."""


@dataclass(frozen=True)
class BackendSpec:
    """What a child needs to build the same backends as the worker (picklable).

    ``names``: backend names (``engine.grammar.registry``); ``tokenizer``: the Hugging Face
    tokenizer; ``vocab_size``, ``stop_token_ids`` as ``registry.create_backend`` takes them;
    ``slow_marker``/``slow_s``: the test hook (module docstring).
    """

    names: tuple[str, ...]
    tokenizer: Any
    vocab_size: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    slow_marker: str = ""
    slow_s: float = 0.0
    start_delay_s: float = 0.0

    def build(self) -> dict[str, Any]:
        """Returns: ``{name: backend}`` (a backend whose package is missing is left out)."""
        from splitserve.engine.grammar.registry import create_backend

        stops = None if self.stop_token_ids is None else list(self.stop_token_ids)
        backends = {}
        for name in self.names:
            try:
                backends[name] = create_backend(name, self.tokenizer, self.vocab_size, stops)
            except ImportError:
                continue
        return backends


@dataclass
class _Job:
    backend: str
    kind: str
    text: str
    options: CompileOptions
    future: Future[Any]


class CompilePool:
    """A few compile processes with a bounded queue and a per-compile deadline.

    Args:
        spec: the backends each child builds.
        num_procs: child processes (each holds the backends: ~0.3 GB with the default model).
        timeout_s: a compile's deadline, from when a child starts it.
        max_queued: compiles that may wait for a child; one more raises :class:`CompileBusy`.
        start_timeout_s: a child not ready this long after it was started is killed.
    """

    def __init__(self, spec: BackendSpec, num_procs: int = 2, timeout_s: float = 30.0,
                 max_queued: int = 16, start_timeout_s: float = START_TIMEOUT_S) -> None:
        if num_procs < 1 or max_queued < 0 or timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError(f"bad compile pool: {num_procs} processes, queue {max_queued}, "
                             f"timeout {timeout_s}, start timeout {start_timeout_s}")
        self.spec = spec
        self.num_procs = num_procs
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self.start_timeout_s = start_timeout_s
        self.kills = 0  # compiles killed at their deadline (each replaced its process)
        self.started = 0  # child processes started, replacements included
        self.ready = 0  # children that have built their backends and wait for compiles
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._procs: dict[int, Any] = {}
        self._running = 0  # compiles handed to a child

    def submit(self, backend: str, kind: str, text: str, options: CompileOptions) -> Future[Any]:
        """Queue one compile on ``backend``.

        Returns:
            A future of the backend's export (``BaseGrammarBackend.export``), or failing with
            ``GrammarError`` (:class:`CompileTimeout` past the deadline).

        Raises:
            CompileBusy: ``max_queued`` compiles already wait.
        """
        job = _Job(backend, kind, text, options, Future())
        with self._cond:
            if self._closed:
                raise CompileBusy("the grammar compile pool is shut down")
            idle = self.num_procs - self._running
            if len(self._queue) >= self.max_queued + max(idle, 0):
                raise CompileBusy(f"{len(self._queue)} grammar compiles are already waiting")
            self._queue.append(job)
            if not self._threads:
                self._start_threads()
            self._cond.notify()
        return job.future

    def cancel(self, future: Future[Any]) -> bool:
        """Drop a compile that has not started. Returns: whether it was dropped."""
        with self._cond:
            for job in self._queue:
                if job.future is future:
                    self._queue.remove(job)
                    job.future.cancel()
                    return True
        return False

    def running(self) -> int:
        """Compiles handed to a child and not yet back."""
        with self._cond:
            return self._running

    def queued(self) -> int:
        """Compiles waiting for a child."""
        with self._cond:
            return len(self._queue)

    def shutdown(self) -> None:
        """Kill the children; queued compiles are cancelled."""
        with self._cond:
            self._closed = True
            while self._queue:
                self._queue.popleft().future.cancel()
            self._cond.notify_all()
            procs = list(self._procs.values())
        for proc in procs:
            proc.kill()
            proc.join(5)

    def _start_threads(self) -> None:
        for slot in range(self.num_procs):
            thread = threading.Thread(target=self._serve, args=(slot,), daemon=True,
                                      name=f"grammar-proc-{slot}")
            thread.start()
            self._threads.append(thread)

    def _start_child(self, slot: int) -> tuple[Any, Connection]:
        """A fresh child for ``slot``, once it has built its backends (that time is not any
        compile's; it is bounded by ``start_timeout_s``).

        Raises:
            EOFError, OSError: the child died while starting; TimeoutError (an OSError): it
            was not ready within ``start_timeout_s`` and was killed.
        """
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_child_main, args=(theirs, self.spec), daemon=True,
                           name=f"splitserve-grammar-{slot}")
        started = time.monotonic()
        proc.start()
        theirs.close()
        with self._cond:
            self.started += 1
            self._procs[slot] = proc
        try:
            if not ours.poll(self.start_timeout_s):
                proc.kill()
                raise TimeoutError(f"not ready {self.start_timeout_s:g}s after it was started "
                                   "(killed)")
            ours.recv()  # "ready"
        except (EOFError, OSError):
            proc.join()
            ours.close()
            raise
        took = time.monotonic() - started
        if took > SLOW_START_S:
            logger.warning("grammar compile process %d took %.1fs to start", slot, took)
        with self._cond:
            self.ready += 1
        return proc, ours

    def _take(self) -> _Job | None:
        """The next compile to run (None: shut down)."""
        with self._cond:
            while True:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return None
                job = self._queue.popleft()
                if job.future.set_running_or_notify_cancel():
                    self._running += 1
                    return job

    def _serve(self, slot: int) -> None:
        """One child's life: take a compile, hand it over, wait for it at most the deadline;
        a child killed or dead is replaced before the next compile."""
        proc: Any = None
        conn: Connection | None = None
        start_error = ""
        while True:
            if self._closed:
                return
            if proc is None:
                try:
                    proc, conn = self._start_child(slot)
                    start_error = ""
                except (EOFError, OSError) as exc:
                    proc, conn = None, None
                    start_error = f"the grammar compile process did not start: {exc!r}"
                    logger.error("%s", start_error)
            job = self._take()
            if job is None:
                return
            try:
                if proc is None or conn is None:
                    job.future.set_exception(CompileUnavailable(start_error))
                    continue
                conn.send((job.backend, job.kind, job.text, job.options))
                if conn.poll(self.timeout_s):
                    status, payload = conn.recv()
                    if status == "ok":
                        job.future.set_result(payload)
                    else:
                        job.future.set_exception(GrammarError(payload))
                    continue
                self.kills += 1
                proc.kill()
                proc.join()
                conn.close()
                proc = None
                self._lost_child()
                job.future.set_exception(CompileTimeout(
                    f"compile timed out after {self.timeout_s:g}s (stopped)"))
            except (EOFError, OSError) as exc:  # the child died (a crash in the backend)
                code = proc.exitcode if proc is not None and not proc.is_alive() else None
                if proc is not None:
                    self._lost_child()
                proc = None
                if not job.future.done():
                    job.future.set_exception(GrammarError(
                        f"the backend's compile process died (exit code {code}: {exc!r})"))
            except Exception as exc:  # e.g. a result that does not unpickle
                # Whatever it was, the compile fails and the child is replaced: this thread
                # must go on serving its slot, or the compiles queued behind would wait forever.
                logger.exception("grammar compile process %d", slot)
                if proc is not None:
                    proc.kill()
                    proc.join()
                    self._lost_child()
                if conn is not None:
                    conn.close()
                proc, conn = None, None
                if not job.future.done():
                    job.future.set_exception(GrammarError(
                        f"the compile process failed: {type(exc).__name__}: {exc}"))
            finally:
                with self._cond:
                    self._running -= 1

    def _lost_child(self) -> None:
        with self._cond:
            self.ready -= 1


def _child_main(conn: Connection, spec: BackendSpec) -> None:
    """A compile process: build the backends, then compile what the worker sends."""
    try:
        os.nice(CHILD_NICE)
    except OSError:
        pass
    parent = os.getppid()
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    if spec.start_delay_s:
        time.sleep(spec.start_delay_s)
    backends = spec.build()
    conn.send("ready")
    while True:
        try:
            name, kind, text, options = conn.recv()
        except EOFError:
            return
        try:
            if spec.slow_marker and spec.slow_marker in text:
                time.sleep(spec.slow_s)
            backend = backends[name]
            conn.send(("ok", backend.export(backend.compile(kind, text, options))))
        except GrammarError as exc:
            conn.send(("error", str(exc)))
        except Exception as exc:  # noqa: BLE001 -- a backend bug: its message, not a dead child
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _exit_with(parent: int) -> None:
    """End this process once the worker that started it is gone (even SIGKILLed), whatever
    the compile thread is doing: a pathological compile must not outlive its worker."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)
