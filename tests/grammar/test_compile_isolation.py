"""Grammar compiles in child processes (``engine.grammar.compile_pool``): a compile past its
deadline is killed and its process replaced, a timed-out constraint fails at once the next time,
a full queue refuses at once, a queued compile whose request went is dropped, and ordinary
compiles do not wait behind pathological ones in flight.

"Pathological" compiles come from the pool's test hook: a child sleeps before compiling a text
that holds the marker, which only a kill ends (the real slow schemas are in
``bench/grammar_isolation.py``). Waits are on futures and counters, not on sleeps."""

from __future__ import annotations

import json
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
from splitserve.engine.grammar.options import CompileOptions

pytestmark = pytest.mark.slow  # starts compile processes (5 in the last test)

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
    spec = BackendSpec(names, tokenizer, slow_marker=MARKER, slow_s=PATIENCE_S * 2)
    pool = CompilePool(spec, num_procs=num_procs, timeout_s=timeout_s, max_queued=max_queued)
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


def test_ordinary_compiles_do_not_wait_behind_pathological_ones(tokenizer, backends) -> None:
    """The compile-isolation goal on the service: 4 pathological compiles in flight, ordinary
    json_schema compiles finish while all 4 still run, at about their idle latency (printed;
    the TTFT figure is ``bench/grammar_isolation.py``'s)."""
    service = _service(tokenizer, backends, ("llguidance",), num_procs=5, timeout_s=PATIENCE_S,
                       max_queued=4)
    pool = service.compile_pool
    try:
        service.compile("json_schema", _schema("warm0"))  # starts the children
        deadline = time.monotonic() + PATIENCE_S
        while pool.ready < 5:  # all built their backends: idle is idle, not start-up
            assert time.monotonic() < deadline, pool.ready
            time.sleep(0.05)

        def latencies(tag: str) -> list[float]:
            out = []
            for i in range(10):
                start = time.perf_counter()
                service.compile("json_schema", _schema(f"{tag}{i}"))
                out.append(time.perf_counter() - start)
            return out

        idle = latencies("idle")
        slow = [service.submit("json_schema", _schema(f"slow{i}", slow=True)) for i in range(4)]
        deadline = time.monotonic() + PATIENCE_S
        while pool.running() < 4:
            assert time.monotonic() < deadline, pool.running()
            time.sleep(0.05)
        loaded = latencies("busy")
        assert not any(f.done() for f in slow) and pool.running() == 4  # all 4 in flight
        ratio = max(loaded) / max(idle)
        print(f"\nordinary compile p99 idle {max(idle) * 1000:.0f} ms, with 4 pathological "
              f"in flight {max(loaded) * 1000:.0f} ms ({ratio:.2f}x)")
    finally:
        service.shutdown()
    wait(slow, PATIENCE_S)
    assert all(f.done() for f in slow)  # shutdown killed them


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
    pool = CompilePool(BackendSpec(("llguidance",), tokenizer), num_procs=1, timeout_s=PATIENCE_S)
    try:
        broken = pool.submit("llguidance", "json_schema", _schema("a"), lambda: None)
        error = broken.exception(timeout=PATIENCE_S)
        assert isinstance(error, GrammarError) and "compile process failed" in str(error), error
        ok = pool.submit("llguidance", "json_schema", _schema("b"), CompileOptions())
        assert ok.exception(timeout=PATIENCE_S) is None
        assert pool.started == 2 and pool.running() == 0  # the broken child was replaced
    finally:
        pool.shutdown()
