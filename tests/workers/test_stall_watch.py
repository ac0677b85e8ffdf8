"""A worker loop stuck in one iteration is logged once, with every thread's stack, and past the
watchdog timeout the process ends (``worker.stall_watch``); a loop that turns is never logged.
A fake clock, no sleeps; the one real exit is a child process's."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading

from splitserve.worker.stall_watch import STUCK_EXIT_CODE, StallWatch, thread_stacks


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


def test_past_the_watchdog_timeout_the_process_ends(caplog) -> None:
    clock, exits = FakeClock(), []
    watch = StallWatch("decode-0", stall_s=120.0, exit_after_s=300.0, clock=clock,
                       terminate=exits.append)
    watch.turn()
    clock.now = 299.0
    with caplog.at_level(logging.WARNING, logger="splitserve.worker.stall_watch"):
        assert watch.check() and exits == []  # logged (past stall_s), still running
        clock.now = 301.0
        assert watch.check() and exits == [STUCK_EXIT_CODE]
    assert "past the watchdog timeout (300s): exiting (code 70)" in caplog.records[-1].getMessage()
    # 0 (--watchdog-timeout 0): never ends the process, however long.
    never = StallWatch("decode-1", exit_after_s=0.0, clock=clock, terminate=exits.append)
    never.turn()
    clock.now += 10_000
    assert never.check() and exits == [STUCK_EXIT_CODE]


def test_a_process_whose_main_thread_never_returns_ends_with_the_stuck_code() -> None:
    """The real exit, from the watch's thread, while the main thread is blocked in C (as a
    step that never returns would be): the process ends with ``STUCK_EXIT_CODE``, the log line
    naming where the main thread was."""
    code = textwrap.dedent("""
        import logging, threading
        from splitserve.worker.stall_watch import StallWatch
        logging.basicConfig(level=logging.INFO)
        watch = StallWatch("colocated-0", stall_s=0.1, exit_after_s=0.3, interval_s=0.05)
        watch.start()
        def stuck_step():
            threading.Event().wait()
        watch.turn()
        stuck_step()
    """)
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == STUCK_EXIT_CODE, (done.returncode, done.stderr)
    assert "past the watchdog timeout (0.3s)" in done.stderr and "in stuck_step" in done.stderr
