"""A worker loop that stops turning says where it stopped, and past a bound ends the worker.

The heartbeat runs on its own thread (``worker.heartbeat``), so a worker whose main loop is
stuck -- a step that never returns, a lock that is never released -- still looks healthy to its
router, and the requests it holds would wait without an error. :class:`StallWatch` is a thread
that looks at the loop's iteration counter every ``interval_s``:

- when one iteration has run longer than ``stall_s`` it logs, once for that iteration, how long
  and every thread's Python stack (the same frames ``py-spy dump`` would show);
- when it has run longer than ``exit_after_s`` (``--watchdog-timeout``, 300 s; 0: never) it
  logs the stacks again and ends the process (``os._exit``, exit code :data:`STUCK_EXIT_CODE`):
  its heartbeats stop, so the router fails its requests over after ``--dead-after`` and stops
  routing to it, and ``splitserve launch`` (or Ray) restarts it. SGLang's scheduler watchdog
  (``--watchdog-timeout``) does the same.

A long step is legitimate (a 2,048-token chunk of a 0.5B model took ~30 s on two loaded cores),
so both bounds are well above it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

logger = logging.getLogger(__name__)

STALL_S = 120.0  # an iteration longer than this is logged with the stacks
STUCK_EXIT_CODE = 70  # EX_SOFTWARE: the worker ended itself, its loop stuck past the watchdog


class StallWatch(threading.Thread):
    """Logs the stacks of every thread when one loop iteration runs longer than ``stall_s``,
    and ends the process when it runs longer than ``exit_after_s``.

    The loop calls :meth:`turn` at the start of each iteration (a counter and a clock read).

    Args:
        name: the worker's id, for the log line.
        stall_s: seconds one iteration may run before it is logged.
        exit_after_s: seconds one iteration may run before the process ends (0: never).
        interval_s: how often the thread looks.
        clock: monotonic seconds (tests pass a fake one).
        terminate: ends the process with a code (``os._exit``: no cleanup can wait on the stuck
            loop; tests pass a recorder).
    """

    def __init__(self, name: str, stall_s: float = STALL_S, exit_after_s: float = 0.0,
                 interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 terminate: Callable[[int], object] = os._exit) -> None:
        super().__init__(name="stall-watch", daemon=True)
        self.worker_name = name
        self.stall_s = stall_s
        self.exit_after_s = exit_after_s
        self.interval_s = interval_s
        self.clock = clock
        self.terminate = terminate
        self.iteration = 0
        self.started_at = clock()
        self.reported = -1  # the last iteration logged
        self.num_reports = 0
        self._stop_event = threading.Event()

    def turn(self) -> None:
        """One more loop iteration starts now."""
        self.started_at = self.clock()
        self.iteration += 1

    def check(self) -> bool:
        """Log the stacks if the current iteration is past ``stall_s`` and was not logged yet;
        end the process if it is past ``exit_after_s``. Returns: whether it logged."""
        iteration, started_at = self.iteration, self.started_at
        waited = self.clock() - started_at
        if self.exit_after_s and waited > self.exit_after_s:
            logger.error("worker %s: its loop has been in one iteration for %.0fs, past the "
                         "watchdog timeout (%gs): exiting (code %d) so that its requests fail "
                         "over and it is restarted; its threads:\n%s", self.worker_name, waited,
                         self.exit_after_s, STUCK_EXIT_CODE, thread_stacks())
            for handler in logging.getLogger().handlers:
                handler.flush()
            self.terminate(STUCK_EXIT_CODE)
            return True
        if waited <= self.stall_s or iteration == self.reported:
            return False
        self.reported = iteration
        self.num_reports += 1
        logger.warning("worker %s: its loop has been in one iteration for %.0fs; its threads:\n%s",
                       self.worker_name, waited, thread_stacks())
        return True

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.check()

    def stop(self) -> None:
        """End the thread (it exits within ``interval_s``)."""
        self._stop_event.set()


def thread_stacks() -> str:
    """Every thread's current Python stack, innermost call last, as text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"--- thread {names.get(ident, ident)}\n{stack}")
    return "\n".join(parts)
