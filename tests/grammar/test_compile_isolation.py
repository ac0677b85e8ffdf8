"""Grammar compiles in child processes (``engine.grammar.compile_pool``): a compile past its
deadline is killed and its process replaced, a timed-out constraint fails at once the next time,
a full queue refuses at once, a queued compile whose request went is dropped, and ordinary
compiles do not wait behind pathological ones in flight (long ones lend their slot and run
demoted).

"Pathological" compiles come from the pool's test hook: a child sleeps before compiling a text
that holds the marker, which only a kill ends (the real slow schemas are in
``bench/grammar_isolation.py``). Waits are on futures and counters, not on sleeps."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import wait

import pytest

from splitserve.engine.grammar import GrammarError, GrammarService
from splitserve.engine.grammar.compile_pool import (
    BackendSpec,
    CompileBusy,
    CompilePool,
    CompileTimeout,  # noqa: F401 (documented type)
    CompileUnavailable,
)
from splitserve.engine.grammar.demote import is_demoted
from splitserve.engine.grammar.options import CompileOptions

pytestmark = pytest.mark.slow  # starts compile processes (5 in one test)

MARKER = "pathological-compile"
PATIENCE_S = 120.0  # only a failing test waits this long


def _schema(name: str, slow: bool = False) -> str:
    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    if slow:
        schema["description"] = MARKER
    return json.dumps(schema)


def _accepts(compiled, tokenizer, text: str) -> bool:
    matcher = compiled.create_matcher()
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def _service(tokenizer, backends, names, num_procs, timeout_s, max_queued):
    """A service on a pool without long-compile slots (``max_long=0``): these tests count
    processes and queued compiles, and on two busy cores an ordinary compile can pass
    ``long_after_s`` and start a further child. The long-compile tests build their own."""
    spec = BackendSpec(names, tokenizer, slow_marker=MARKER, slow_s=PATIENCE_S * 2)
    pool = CompilePool(spec, num_procs=num_procs, timeout_s=timeout_s, max_queued=max_queued,
                       max_long=0)
    return GrammarService([backends[n] for n in names], pool=pool, remember_timeouts_s=600.0)


def test_a_compile_past_its_deadline_is_killed_and_remembered(tokenizer, backends) -> None:
    service = _service(tokenizer, backends, ("xgrammar",), num_procs=1, timeout_s=5.0,
                       max_queued=1)
    pool = service.compile_pool
    try:
        # Proven in a child (it finished in time), compiled again here (xgrammar ships nothing).
        warm = service.compile("json_schema", _schema("warm"))
        assert warm.backend_name == "xgrammar" and pool.started == 1
        direct = backends["xgrammar"].compile("json_schema", _schema("warm"))
        for text in ('{"warm":1}', '{"warm": 1}', '{"warm":"x"}', '{"warm":12}'):
            ids = tokenizer.encode(text, add_special_tokens=False)
            a, b = warm.create_matcher(), direct.create_matcher()
            assert [a.accept_token(t) for t in ids] == [b.accept_token(t) for t in ids], text
        assert _accepts(warm, tokenizer, '{"warm":12}')
        child = pool._procs[0]
        with pytest.raises(GrammarError, match=r"timed out after 5s \(stopped\)"):
            service.compile("json_schema", _schema("slow", slow=True))
        child.join(PATIENCE_S)
        assert pool.kills == 1 and child.exitcode == -9  # SIGKILL, not left running
        # The same schema again: failed already, naming the timeout, without a compile.
        again = service.submit("json_schema", _schema("slow", slow=True))
        assert again.done() and "remembered" in str(again.exception()) and pool.kills == 1
        # A fresh process took the killed one's place.
        assert service.compile("json_schema", _schema("after")).backend_name == "xgrammar"
        assert pool.started == 2
    finally:
        service.shutdown()


def test_a_full_queue_refuses_and_a_gone_request_leaves_it(tokenizer, backends) -> None:
    service = _service(tokenizer, backends, ("llguidance",), num_procs=1, timeout_s=PATIENCE_S,
                       max_queued=1)
    pool = service.compile_pool
    try:
        running = service.submit("json_schema", _schema("a", slow=True))
        deadline = time.monotonic() + PATIENCE_S
        while pool.running() < 1:  # the child is starting; the compile is handed over then
            assert time.monotonic() < deadline
            time.sleep(0.05)
        queued = service.submit("json_schema", _schema("b", slow=True))
        assert pool.queued() == 1
        refused = service.submit("json_schema", _schema("c"))
        assert refused.done() and isinstance(refused.exception(), CompileBusy)
        assert not service.is_cached("json_schema", _schema("c"))  # a later try compiles it
        # Its request went: the queued compile is dropped, and the queue has room again.
        assert service.release("json_schema", _schema("b", slow=True))
        assert queued.done() and "cancelled" in str(queued.exception()) and pool.queued() == 0
        assert not running.done()
    finally:
        service.shutdown()


def _wait_for(condition, what) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


def test_ordinary_compiles_do_not_wait_behind_pathological_ones(tokenizer, backends) -> None:
    """The compile-isolation goal on the service, with ONE ordinary compile process: 4
    pathological compiles in flight each pass ``long_after_s``, lend their slot to a further
    child (up to ``max_long``) and run demoted; ordinary json_schema compiles then finish while
    all 4 still run, at about their idle latency (printed; the CPU-bound figure with real
    schemas is ``bench/grammar_isolation.py``'s)."""
    spec = BackendSpec(("llguidance",), tokenizer, slow_marker=MARKER, slow_s=PATIENCE_S * 2)
    pool = CompilePool(spec, num_procs=1, timeout_s=PATIENCE_S, max_queued=4,
                       long_after_s=0.5, max_long=4)
    service = GrammarService([backends["llguidance"]], pool=pool)
    try:
        service.compile("json_schema", _schema("warm0"))  # starts the first child
        assert pool.children() == 1

        def latencies(tag: str) -> list[float]:
            out = []
            for i in range(10):
                start = time.perf_counter()
                service.compile("json_schema", _schema(f"{tag}{i}"))
                out.append(time.perf_counter() - start)
            return out

        idle = latencies("idle")
        slow = [service.submit("json_schema", _schema(f"slow{i}", slow=True)) for i in range(4)]
        # Each long one added a child: 4 hold the pathological compiles, a fifth is free.
        _wait_for(lambda: pool.running_long() == 4 and pool.ready == 5,
                  lambda: (pool.running_long(), pool.ready, pool.children()))
        assert pool.children() == 5 and pool.queued() == 0
        loaded = latencies("busy")
        assert not any(f.done() for f in slow) and pool.running_long() == 4  # all 4 in flight
        ratio = max(loaded) / max(idle)
        print(f"\nordinary compile p99 idle {max(idle) * 1000:.0f} ms, with 4 pathological "
              f"in flight {max(loaded) * 1000:.0f} ms ({ratio:.2f}x)")
        # A fifth pathological compile takes the free child and becomes long too, but no
        # sixth child is started (max_long): the next ordinary compile queues.
        fifth = service.submit("json_schema", _schema("slow4", slow=True))
        _wait_for(lambda: pool.running_long() == 5, lambda: pool.running_long())
        assert pool.children() == 5 and not fifth.done()
        queued = service.submit("json_schema", _schema("after"))
        assert pool.queued() == 1 and not queued.done()
    finally:
        service.shutdown()
    wait(slow, PATIENCE_S)
    assert all(f.done() for f in slow)  # shutdown killed them


def test_a_long_compile_runs_demoted_and_its_rebuild_too(tokenizer, backends, monkeypatch) -> None:
    """Past ``long_after_s`` the child moves the compile's threads to SCHED_IDLE (its main
    thread, which only waits, keeps its priority); ordinary compiles meanwhile use the free
    child and start no other (a start costs seconds of CPU: an e2e TTFT doubled when every
    ordinary compile beside long ones started one); a long compile that finishes is rebuilt
    in the worker at nice 19, an ordinary one on the service's ordinary threads."""
    # long_after_s well above an ordinary compile even on two busy cores (one that became long
    # would start a child of its own), slow_s well above the ordinary compiles beside it.
    spec = BackendSpec(("llguidance",), tokenizer, slow_marker=MARKER, slow_s=20.0)
    pool = CompilePool(spec, num_procs=2, timeout_s=PATIENCE_S, long_after_s=2.0)
    rebuilt = []
    backend = backends["llguidance"]
    original = backend.restore

    def restore(*args):
        tid = threading.get_native_id()
        rebuilt.append((threading.current_thread().name, is_demoted(tid)))
        return original(*args)

    monkeypatch.setattr(backend, "restore", restore)
    service = GrammarService([backend], pool=pool)
    try:
        service.compile("json_schema", _schema("quick"))
        assert rebuilt == [(rebuilt[0][0], False)] and "rebuild-long" not in rebuilt[0][0]
        _wait_for(lambda: pool.ready == 2, lambda: pool.ready)
        slow = service.submit("json_schema", _schema("slow", slow=True))
        _wait_for(lambda: pool.running_long() == 1, lambda: pool.running_long())

        def demoted() -> dict[int, list[int]]:
            out: dict[int, list[int]] = {}
            for proc in list(pool._procs.values()):
                for tid in os.listdir(f"/proc/{proc.pid}/task"):
                    try:
                        if is_demoted(int(tid)):
                            out.setdefault(proc.pid, []).append(int(tid))
                    except OSError:  # a thread that just ended
                        pass
            return out

        _wait_for(lambda: demoted(), lambda: "no demoted thread in any child")
        [(child, tids)] = demoted().items()  # one child holds it
        assert child not in tids  # the child's main thread only waits: not demoted
        for i in range(3):  # ordinary compiles beside it take the free child
            service.compile("json_schema", _schema(f"beside{i}"))
        assert not slow.done() and pool.children() == 2 and pool.started == 2
        assert slow.result(timeout=PATIENCE_S).backend_name == "llguidance"
        assert ("grammar-rebuild-long", True) in rebuilt, rebuilt
        assert not is_demoted(threading.main_thread().native_id)  # only the rebuild's thread
        assert [d for name, d in rebuilt if name != "grammar-rebuild-long"] == [False] * 4
        service.compile("json_schema", _schema("after"))
        assert rebuilt[-1][1] is False and pool.kills == 0
    finally:
        service.shutdown()


def test_a_child_that_never_gets_ready_is_killed_and_its_compile_fails(tokenizer,
                                                                       backends) -> None:
    """A compile process stuck before it is ready (here: the start hook's sleep) is killed at
    the start deadline; the compile waiting for it fails saying so instead of waiting for ever,
    and a fresh process is started for the next compile. The failure is ours, not the
    constraint's: a busy refusal (503 with Retry-After), not a 400, not cached, and the chain's
    next backend is not tried in a process that will not start either."""
    spec = BackendSpec(("llguidance", "xgrammar"), tokenizer, start_delay_s=PATIENCE_S * 2)
    pool = CompilePool(spec, num_procs=1, timeout_s=5.0, max_queued=1, start_timeout_s=2.0)
    service = GrammarService([backends["llguidance"], backends["xgrammar"]], pool=pool)
    try:
        future = service.submit("json_schema", _schema("a"))
        error = future.exception(timeout=PATIENCE_S)
        assert isinstance(error, CompileUnavailable) and isinstance(error, CompileBusy), error
        assert not isinstance(error, GrammarError), error  # GrammarError is the 400 kind
        assert "did not start" in str(error) and "not ready 2s after" in str(error), error
        # The chain stopped there: xgrammar's compile was not queued for the next process.
        assert "xgrammar" not in str(error) and pool.queued() == 0, (str(error), pool.queued())
        assert not service.is_cached("json_schema", _schema("a"))  # a retry compiles again
        assert pool.ready == 0 and pool.kills == 0  # no compile was ever handed over
        deadline = time.monotonic() + PATIENCE_S
        while pool.started < 2:  # the slot starts another process for the next compile
            assert time.monotonic() < deadline, pool.started
            time.sleep(0.05)
    finally:
        service.shutdown()


def test_a_compile_that_breaks_the_pipe_fails_alone_and_the_slot_goes_on(tokenizer) -> None:
    """Whatever goes wrong while a child holds a compile (here: options that cannot be
    pickled to it), that compile fails and the slot's thread serves the next one: a thread that
    died there would leave every later compile queued for ever."""
    pool = CompilePool(BackendSpec(("llguidance",), tokenizer), num_procs=1, timeout_s=PATIENCE_S,
                       max_long=0)
    try:
        broken = pool.submit("llguidance", "json_schema", _schema("a"), lambda: None)
        error = broken.exception(timeout=PATIENCE_S)
        assert isinstance(error, GrammarError) and "compile process failed" in str(error), error
        ok = pool.submit("llguidance", "json_schema", _schema("b"), CompileOptions())
        assert ok.exception(timeout=PATIENCE_S) is None
        assert pool.started == 2 and pool.running() == 0  # the broken child was replaced
    finally:
        pool.shutdown()


def test_a_child_whose_start_raises_fails_its_compile_and_the_slot_goes_on(tokenizer,
                                                                         monkeypatch) -> None:
    """``Process.start`` raising something other than OSError (RuntimeError when the main
    module is still importing) killed the slot's thread before, and every compile after it
    waited for ever; now that compile fails as unavailable (503) and the slot starts the next
    child."""
    import multiprocessing.context

    real_start = multiprocessing.context.SpawnProcess.start
    calls = []

    def start_once_broken(self):
        calls.append(self.name)
        if len(calls) == 1:
            raise RuntimeError("start refused (test)")
        return real_start(self)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start_once_broken)
    pool = CompilePool(BackendSpec(("llguidance",), tokenizer), num_procs=1, timeout_s=PATIENCE_S,
                       max_long=0)
    try:
        first = pool.submit("llguidance", "json_schema", _schema("a"), CompileOptions())
        error = first.exception(timeout=PATIENCE_S)
        assert isinstance(error, CompileUnavailable) and "start refused" in str(error), error
        second = pool.submit("llguidance", "json_schema", _schema("b"), CompileOptions())
        assert second.exception(timeout=PATIENCE_S) is None and len(calls) == 2
    finally:
        pool.shutdown()
