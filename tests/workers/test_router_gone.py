"""A worker ends the requests of a router that went away and frees their pages
(``worker.routers``): at once when the router's link drops (the process exited), after the
router's own ``dead_after_s`` of silence when it is cut off (no ``RouterBeat``). Driven
in-process, the silence on the worker's fake clock; the watch's rules alone first."""

from __future__ import annotations

import time
from pathlib import Path

from splitserve.ipc.messages import (
    AbortTask,
    GenerateTask,
    RequestError,
    RouterBeat,
    SamplingParams,
    TokenBatch,
)
from splitserve.ipc.sockets import Inbox, free_tcp_addr
from splitserve.worker.main import create_worker
from splitserve.worker.routers import RouterWatch
from tests.cluster_config import worker_config


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_watch_rules() -> None:
    clock, drops, watched = FakeClock(), {"a": 0, "b": 0, "c": 0}, []
    watch = RouterWatch(lambda addr: drops[addr], watched.append, clock)
    watch.heard("a", dead_after_s=2.0)  # beats
    watch.heard("b")  # never beat: only its link can end it
    watch.heard("c", dead_after_s=2.0)
    assert watched == ["a", "b", "c"]  # each link watched from the first message on
    clock.t += 0.5
    assert watch.gone(clock.t, ["a", "b", "c"]) == []
    watch.heard("c")
    for _ in range(6):  # 1.8 s more in small steps: no stall credit
        clock.t += 0.3
        gone = watch.gone(clock.t, ["a", "b", "c"])
    assert gone == [("a", "sent nothing for 2 s")]  # c spoke at 0.5 s, b has no bound
    drops["b"] += 1
    assert watch.gone(clock.t, ["b"]) == [("b", "closed its link")]
    assert watch.gone(clock.t, ["b"]) == []  # acted on once; a new router there is new
    assert watch.gone(clock.t, ["unknown"]) == []
    # A stall of this loop (10 s between checks) is not the router's silence.
    watch.heard("a", dead_after_s=2.0)
    clock.t += 10.0
    assert watch.gone(clock.t, ["a"]) == []


def pump(worker, inbox: Inbox, until, timeout_s: float, beat: RouterBeat | None = None) -> list:
    """Run the worker loop until ``until(messages)`` holds (``beat`` sent every 0.2 s)."""
    got, next_beat = [], 0.0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if beat is not None and time.monotonic() >= next_beat:
            worker.dispatch(beat, [])
            next_beat = time.monotonic() + 0.2
        worker.run_once(idle_wait_ms=10)
        while (item := inbox.recv()) is not None:
            got.append(item[0])
        if until(got):
            return got
    raise AssertionError(f"condition not met in {timeout_s:g} s; received {got}")


def held_pages(worker) -> int:
    return worker.pool.allocator.num_used - worker.scheduler.cache.stats().evictable_pages


def long_task(server: Inbox, rid: str, prefill_addr: str | None = None) -> GenerateTask:
    return GenerateTask(rid=rid, input_ids=list(range(10, 60)), reply_addr=server.addr,
                        sampling=SamplingParams(max_new_tokens=400, temperature=0,
                                                ignore_eos=True),
                        prefill_addr=prefill_addr)


def _frozen(worker) -> FakeClock:
    """Put ``worker`` on a fake clock that starts at its current time; advanced by the test."""
    clock = FakeClock()
    clock.t = worker.now()
    worker.clock = clock
    return clock


def _advance(worker, clock: FakeClock, seconds: float, step_s: float = 0.1) -> None:
    """Run the worker loop while its clock moves ``seconds`` forward in small steps (no stall
    credit: each step is far below ``STALL_S``)."""
    end = clock.t + seconds
    while clock.t < end - 1e-9:
        clock.t = min(end, clock.t + step_s)
        worker.run_once()


def test_silent_router_requests_end_after_its_bound(ctx, model_path: Path) -> None:
    """A decode worker holding pages for a request whose prefill worker is slow (the transfer
    deadline is far): the router stops beating, and once its dead_after_s has passed on the
    worker's clock (a fake one: no wall-clock window) the request ends, its pages freed, and
    a 503 goes to the router in case the link comes back."""
    server, prefill = Inbox(ctx, free_tcp_addr()), Inbox(ctx, free_tcp_addr())
    worker = create_worker(worker_config(model_path, "decode", server.addr, kv_cache_mb=16,
                                         transfer_timeout_s=60.0))
    clock = _frozen(worker)
    worker.dispatch(RouterBeat(server.addr, dead_after_s=0.6), [])
    worker.dispatch(long_task(server, "r-cut", prefill.addr), [])
    assert held_pages(worker) > 0  # reserved for the prompt
    _advance(worker, clock, 0.5)
    assert worker.stats().requests_orphaned == 0 and held_pages(worker) > 0  # within bound
    _advance(worker, clock, 0.5)  # 1.0 s of silence: past 0.6 s and a router check
    assert worker.stats().requests_orphaned == 1
    assert held_pages(worker) == 0 and not worker.sessions
    got = pump(worker, server, lambda g: any(isinstance(m, RequestError) for m in g), 60.0)
    err = next(m for m in got if isinstance(m, RequestError))
    assert err.rid == "r-cut" and err.code == 503 and "sent nothing for 0.6 s" in err.message


def test_beating_router_keeps_its_requests(ctx, model_path: Path) -> None:
    server, prefill = Inbox(ctx, free_tcp_addr()), Inbox(ctx, free_tcp_addr())
    worker = create_worker(worker_config(model_path, "decode", server.addr, kv_cache_mb=16,
                                         transfer_timeout_s=60.0))
    clock = _frozen(worker)
    beat = RouterBeat(server.addr, dead_after_s=0.4)
    worker.dispatch(beat, [])
    worker.dispatch(long_task(server, "r-kept", prefill.addr), [])
    for _ in range(10):  # 2 s on the worker's clock, a beat every 0.2 s
        _advance(worker, clock, 0.2)
        worker.dispatch(beat, [])
    assert worker.stats().requests_orphaned == 0
    assert held_pages(worker) > 0 and "r-kept" in worker.sessions
    while (item := server.recv()) is not None:
        assert not isinstance(item[0], RequestError), item[0]
    worker.dispatch(AbortTask("r-kept"), [])
    assert held_pages(worker) == 0


def test_router_exit_ends_its_streams_at_once(ctx, model_path: Path) -> None:
    """A colocated worker streaming a long generation: the router's inbox closes (its process
    exited); the worker sees its link drop and frees the request's pages, long before the
    generation would have ended."""
    server = Inbox(ctx, free_tcp_addr())
    worker = create_worker(worker_config(model_path, "colocated", server.addr,
                                         kv_cache_mb=16))
    worker.dispatch(long_task(server, "r-gone"), [])
    pump(worker, server, lambda g: any(isinstance(m, TokenBatch) for m in g), 30.0)
    assert held_pages(worker) > 0
    server.close()
    deadline = time.monotonic() + 60.0  # liveness only: the link drop is the event
    while held_pages(worker) and time.monotonic() < deadline:
        worker.run_once(idle_wait_ms=10)
    assert held_pages(worker) == 0, "pages still held 60 s after the router's link dropped"
    # Ended by the drop (orphaned), not by finishing its 400 tokens; no beat was ever sent,
    # so no silence bound could have ended it.
    assert not worker.scheduler.has_work and worker.stats().requests_orphaned == 1
