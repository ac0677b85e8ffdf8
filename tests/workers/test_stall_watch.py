"""A worker loop stuck in one iteration is logged once, with every thread's stack
(``worker.stall_watch``); a loop that turns is never logged. A fake clock, no sleeps."""

from __future__ import annotations

import logging
import threading

from splitserve.worker.stall_watch import StallWatch, thread_stacks


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_stuck_iteration_is_logged_once_with_the_stacks(caplog) -> None:
    clock = FakeClock()
    watch = StallWatch("decode-0", stall_s=120.0, clock=clock)
    watch.turn()
    clock.now = 119.0
    assert not watch.check()  # a long step, not a stall
    clock.now = 121.0
    with caplog.at_level(logging.WARNING, logger="splitserve.worker.stall_watch"):
        assert watch.check()
        assert not watch.check()  # once per iteration
    (record,) = caplog.records
    assert "decode-0" in record.getMessage() and "121s" in record.getMessage()
    assert "test_a_stuck_iteration_is_logged_once_with_the_stacks" in record.getMessage()
    # The loop turns again and later sticks again: logged again.
    watch.turn()
    clock.now = 200.0
    assert not watch.check()
    clock.now = 250.0
    assert watch.check() and watch.num_reports == 2


def test_a_turning_loop_is_never_logged() -> None:
    clock = FakeClock()
    watch = StallWatch("prefill-0", stall_s=1.0, clock=clock)
    for _ in range(100):
        watch.turn()
        clock.now += 0.9
        assert not watch.check()
    assert watch.num_reports == 0


def test_thread_stacks_names_every_thread() -> None:
    started, release = threading.Event(), threading.Event()

    def parked() -> None:
        started.set()
        release.wait()

    thread = threading.Thread(target=parked, name="parked-thread")
    thread.start()
    started.wait()
    try:
        text = thread_stacks()
        assert "--- thread parked-thread" in text and "in parked" in text
        assert "--- thread MainThread" in text
    finally:
        release.set()
        thread.join()
