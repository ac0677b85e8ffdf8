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
- A compile that has run past ``long_after_s`` (1 s) is *long*: the child moves its threads to
  ``SCHED_IDLE`` (``engine.grammar.demote``: it gets only CPU time nobody else wants, so it cannot
  slow the model or other compiles on a small host), and it stops counting against
  ``num_procs``: up to ``max_long`` long compiles run beside ``num_procs`` ordinary ones, each
  long one lending its slot to a further child (started when compiles wait or no child is free,
  then kept).
  So 4 pathological schemas in flight neither hold every process nor share the CPU with an
  ordinary compile as equals (``bench/grammar_isolation.py``).
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
from splitserve.engine.grammar.demote import demote_thread, own_thread_ids
from splitserve.engine.grammar.options import CompileOptions

logger = logging.getLogger(__name__)

CHILD_NICE = 10
PARENT_POLL_S = 1.0  # how often a child checks that its worker is still there
# A child's start (imports, then every backend built for the model's vocabulary) took ~10 s on
# a quiet 2-core Zen 3 with Qwen2.5's 151k tokens and ~65 s beside a test run; past this bound
# it is killed and the compiles waiting for it fail.
START_TIMEOUT_S = 180.0
SLOW_START_S = 30.0  # a start slower than this is logged (with how long it took)
LONG_AFTER_S = 1.0  # a compile running longer is long: demoted, and off the ordinary slots
MAX_LONG = 4  # long compiles beside the ordinary ones (each on a further child)
DEMOTE_SWEEP_S = 0.25  # how often a long compile's new threads are demoted


class CompileBusy(RuntimeError):
    """The compile queue is full: the request should be retried later (HTTP 503)."""


class CompileUnavailable(CompileBusy):
    """No compile process could be started for this compile (it died or was not ready within
    ``start_timeout_s``): our fault, not the constraint's, so a 503 to retry like
    :class:`CompileBusy`, not a 400."""


class CompileTimeout(GrammarError):
    """A compile ran past its deadline and its process was killed."""


@dataclass(frozen=True)
class Shipped:
    """A compile a child finished: ``payload``, the backend's export
    (``BaseGrammarBackend.export``); ``compile_s``, seconds the child spent (wall clock, from
    handing it over to the reply; past ``CompilePool.long_after_s`` it ran demoted)."""

    payload: Any
    compile_s: float


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
        long_after_s: a compile running longer is long (module docstring): demoted, and no
            longer counted against ``num_procs``.
        max_long: long compiles that may run beside ``num_procs`` ordinary ones (each beyond
            ``num_procs`` on a child of its own: at most ``num_procs + max_long`` children).
    """

    def __init__(self, spec: BackendSpec, num_procs: int = 2, timeout_s: float = 30.0,
                 max_queued: int = 16, start_timeout_s: float = START_TIMEOUT_S,
                 long_after_s: float = LONG_AFTER_S, max_long: int = MAX_LONG) -> None:
        if (num_procs < 1 or max_queued < 0 or timeout_s <= 0 or start_timeout_s <= 0
                or long_after_s <= 0 or max_long < 0):
            raise ValueError(f"bad compile pool: {num_procs} processes, queue {max_queued}, "
                             f"timeout {timeout_s}, start timeout {start_timeout_s}, long after "
                             f"{long_after_s}, {max_long} long")
        self.spec = spec
        self.num_procs = num_procs
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self.start_timeout_s = start_timeout_s
        self.long_after_s = long_after_s
        self.max_long = max_long
        self.kills = 0  # compiles killed at their deadline (each replaced its process)
        self.started = 0  # child processes started, replacements included
        self.ready = 0  # children that have built their backends and wait for compiles
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._procs: dict[int, Any] = {}
        self._running = 0  # compiles handed to a child
        self._long = 0  # of those, the ones past long_after_s

    def submit(self, backend: str, kind: str, text: str, options: CompileOptions) -> Future[Any]:
        """Queue one compile on ``backend``.

        Returns:
            A future of :class:`Shipped` (the backend's export, ``BaseGrammarBackend.export``,
            and how long the child compiled), or failing with ``GrammarError``
            (:class:`CompileTimeout` past the deadline).

        Raises:
            CompileBusy: ``max_queued`` compiles already wait.
        """
        job = _Job(backend, kind, text, options, Future())
        with self._cond:
            if self._closed:
                raise CompileBusy("the grammar compile pool is shut down")
            idle = self.num_procs - (self._running - self._long)
            if len(self._queue) >= self.max_queued + max(idle, 0):
                raise CompileBusy(f"{len(self._queue)} grammar compiles are already waiting")
            self._queue.append(job)
            if not self._threads:
                self._start_threads()
            self._maybe_grow()
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

    def running_long(self) -> int:
        """Compiles handed to a child that have run past ``long_after_s`` and not yet ended."""
        with self._cond:
            return self._long

    def children(self) -> int:
        """Slots with a child (``num_procs``, plus one per long compile ever run at once, up
        to ``max_long``)."""
        with self._cond:
            return len(self._threads)

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
        for _ in range(self.num_procs):
            self._add_slot()

    def _add_slot(self) -> None:
        """Start one more slot (its thread starts its child). Caller holds ``_cond`` or runs
        before any thread exists."""
        slot = len(self._threads)
        thread = threading.Thread(target=self._serve, args=(slot,), daemon=True,
                                  name=f"grammar-proc-{slot}")
        self._threads.append(thread)
        thread.start()

    def _became_long(self) -> None:
        """A compile passed ``long_after_s``: it no longer holds an ordinary slot."""
        with self._cond:
            self._long += 1
            self._maybe_grow()
            self._cond.notify_all()

    def _maybe_grow(self) -> None:
        """Add a slot while long compiles hold slots and either more compiles wait than
        slots are free or none is free for the next one, up to one per long compile and
        ``max_long`` in all (so a host whose compiles are only a little slow, or one with a free
        child, does not start children it never uses: a start costs seconds of CPU). Caller
        holds ``_cond``."""
        slots = len(self._threads)
        free = slots - self._running  # slots not holding a compile (their child may be starting)
        if (not self._closed and (free == 0 or len(self._queue) > free)
                and slots < self.num_procs + min(self._long, self.max_long)):
            self._add_slot()

    def _start_child(self, slot: int) -> tuple[Any, Connection]:
        """A fresh child for ``slot``, once it has built its backends (that time is not any
        compile's; it is bounded by ``start_timeout_s``).

        Raises:
            EOFError, OSError: the child died while starting; TimeoutError (an OSError): it
            was not ready within ``start_timeout_s`` and was killed; whatever
            ``Process.start`` raises (RuntimeError when the main module is still importing).
        """
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_child_main, args=(theirs, self.spec, self.long_after_s),
                           daemon=True, name=f"splitserve-grammar-{slot}")
        started = time.monotonic()
        try:
            proc.start()
        except BaseException:
            ours.close()
            raise
        finally:
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
        """The next compile to run, once fewer than ``num_procs`` ordinary (not long)
        compiles run (None: shut down)."""
        with self._cond:
            while True:
                while not self._closed and (
                        not self._queue or self._running - self._long >= self.num_procs):
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
                except Exception as exc:  # noqa: BLE001 -- whatever it is, the slot goes on
                    proc, conn = None, None
                    start_error = f"the grammar compile process did not start: {exc!r}"
                    logger.error("%s", start_error)
            job = self._take()
            if job is None:
                return
            long = False
            try:
                if proc is None or conn is None:
                    job.future.set_exception(CompileUnavailable(start_error))
                    continue
                conn.send((job.backend, job.kind, job.text, job.options))
                first = min(self.long_after_s, self.timeout_s)
                done = conn.poll(first)
                if not done and first < self.timeout_s:
                    long = True
                    self._became_long()
                    done = conn.poll(self.timeout_s - first)
                if done:
                    status, payload, seconds = conn.recv()
                    if status == "ok":
                        job.future.set_result(Shipped(payload, seconds))
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
                    if long:
                        self._long -= 1
                    self._cond.notify_all()  # a slot may take a compile again

    def _lost_child(self) -> None:
        with self._cond:
            self.ready -= 1


def _child_main(conn: Connection, spec: BackendSpec, long_after_s: float) -> None:
    """A compile process: build the backends, then compile what the worker sends, each on a
    fresh thread; one that runs past ``long_after_s`` is demoted with every thread it started."""
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
        reply: list[tuple[str, Any]] = []
        thread = threading.Thread(target=_compile, args=(reply, spec, backends, name, kind, text,
                                                        options), daemon=True, name="compile")
        keep = own_thread_ids()  # this thread, the parent watch, the libraries' own pools
        started = time.monotonic()
        thread.start()
        thread.join(long_after_s)
        demoted: set[int] = set()
        while thread.is_alive():  # long: demote it and the threads it started, never `keep`
            for tid in own_thread_ids() - keep - demoted:
                if demote_thread(tid):
                    demoted.add(tid)
            thread.join(DEMOTE_SWEEP_S)
        status, payload = reply[0] if reply else ("error", "the compile thread gave no result")
        conn.send((status, payload, time.monotonic() - started))


def _compile(reply: list[tuple[str, Any]], spec: BackendSpec, backends: dict[str, Any],
             name: str, kind: str, text: str, options: CompileOptions) -> None:
    """One compile on its own thread: ``("ok", export)`` or ``("error", message)``."""
    try:
        if spec.slow_marker and spec.slow_marker in text:
            time.sleep(spec.slow_s)
        backend = backends[name]
        reply.append(("ok", backend.export(backend.compile(kind, text, options))))
    except GrammarError as exc:
        reply.append(("error", str(exc)))
    except Exception as exc:  # noqa: BLE001 -- a backend bug: its message, not a dead child
        reply.append(("error", f"{type(exc).__name__}: {exc}"))


def _exit_with(parent: int) -> None:
    """End this process once the worker that started it is gone (even SIGKILLed), whatever
    the compile thread is doing: a pathological compile must not outlive its worker."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)
