"""Keepalives that go out while one engine step runs.

The prefill worker tells each decode worker waiting for one of its prompts that the prompt is
still being computed (``KVKeepalive``) every third of ``transfer_timeout_s``, from its loop,
between steps. One step can be longer than that: a 2,048-token chunk of a 0.5B model took ~30 s
on two loaded cores, so the decode worker's deadline (``WAITING_FOR_PAGES``, restarted by every
message of the request) ran out and a healthy request failed with a 504.

:class:`StepKeepalive` is a thread with its own sockets (ZeroMQ sockets belong to one thread;
the heartbeat does the same: ``worker.heartbeat``). Before a step the loop gives it the
messages to repeat (:meth:`begin`); while the step runs (torch releases the GIL while it
computes) the thread sends them every ``interval_s``; after the step (:meth:`end`) it is quiet
until the next one. The decode side ignores a keepalive that arrives late (after the pages it
announces, on another link): its transition table lists it as late in every later state.

A step that never returns (a hung kernel) must still end in a timeout, so the thread repeats a
step's messages for at most ``limit_s`` (default 10 × ``transfer_timeout_s``). The thread
exits, closing its sockets, after ``idle_exit_s`` without a step to keep alive, and the next
:meth:`begin` starts another: an idle or forgotten worker holds no thread that would keep its
ZeroMQ context from ending.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from splitserve.ipc.messages import Message, encode

logger = logging.getLogger(__name__)

SEND_HWM = 8  # a peer that does not read gets no backlog of keepalives


class StepKeepalive:
    """Repeats a step's keepalives on a thread of its own while the step runs.

    Args:
        ctx: the worker's ZeroMQ context (the thread's sockets are its own).
        interval_s: seconds between two sends of one step's messages (``transfer_timeout_s /
            3``); the first goes out ``interval_s`` after :meth:`begin`.
        limit_s: a step's messages are repeated for at most this many seconds.
        configure: makes a new socket a CURVE client when the links are encrypted
            (``WorkerLinks.configure_client``).
        clock: seconds, monotonic.
        idle_exit_s: the thread ends after this long with no step to keep alive.

    Raises:
        ValueError: ``interval_s``, ``limit_s`` or ``idle_exit_s`` not positive.

    :meth:`close` ends the thread and closes its sockets (call it before the context ends).
    """

    def __init__(self, ctx: zmq.Context, interval_s: float, limit_s: float,
                 configure: Callable[[zmq.Socket], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, idle_exit_s: float = 30.0) -> None:
        if min(interval_s, limit_s, idle_exit_s) <= 0:
            raise ValueError("interval_s, limit_s and idle_exit_s must be positive "
                             f"({interval_s}, {limit_s}, {idle_exit_s})")
        self.ctx, self.interval_s, self.limit_s = ctx, interval_s, limit_s
        self.configure, self.clock, self.idle_exit_s = configure, clock, idle_exit_s
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None  # None: none running
        self._step = 0  # counts the steps begun; the thread repeats the latest one's messages
        self._messages: list[tuple[str, Message]] = []  # empty: no step to keep alive
        self._started_at = 0.0
        self._closed = False
        self.num_sent = 0  # messages sent
        self.num_past_limit = 0  # sends not made because the step ran past ``limit_s``
        self.num_threads = 0  # threads started (one per busy period)

    @property
    def is_running(self) -> bool:
        """Whether a thread is up (it ends ``idle_exit_s`` after the last step it kept alive)."""
        with self._cond:
            return self._thread is not None

    def begin(self, messages: list[tuple[str, Message]]) -> None:
        """A step starts: repeat ``messages`` (``(peer inbox address, message)``) until
        :meth:`end`. No messages: nothing happens (no thread is started for it)."""
        if not messages:
            return
        with self._cond:
            if self._closed:
                return
            self._step += 1
            self._messages = messages  # encoded only if the step outlasts interval_s
            self._started_at = self.clock()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="step-keepalive",
                                                daemon=True)
                self.num_threads += 1
                self._thread.start()
            self._cond.notify()

    def end(self) -> None:
        """The step is over: no message of it goes out after this returns."""
        with self._cond:
            if self._messages:
                self._messages = []
                self._cond.notify()

    def close(self) -> None:
        """End the thread; its sockets are closed when this returns. Later steps are not kept
        alive."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        socks: dict[str, zmq.Socket] = {}
        try:
            with self._cond:
                while self._wait_for_step():
                    self._repeat(socks)
        finally:
            for sock in socks.values():
                sock.close(0)

    def _wait_for_step(self) -> bool:
        """Under the lock: until a step has messages (True), or the thread is to end (False:
        closed, or ``idle_exit_s`` without a step; it is marked gone here, under the lock, so
        the next :meth:`begin` starts another)."""
        ready = self._cond.wait_for(lambda: self._closed or bool(self._messages),
                                    timeout=self.idle_exit_s)
        if ready and not self._closed:
            return True
        self._thread = None
        return False

    def _repeat(self, socks: dict[str, zmq.Socket]) -> None:
        """Under the lock: send the current step's messages every ``interval_s`` (the first
        one interval after it began) until it ends, another begins, or the thread closes."""
        step = self._step
        due = self._started_at + self.interval_s
        while not self._closed and self._step == step and self._messages:
            left = due - self.clock()
            if left > 0:
                self._cond.wait(left)
                continue
            if self.clock() - self._started_at <= self.limit_s:
                self._send(socks, self._messages)
            else:
                self.num_past_limit += 1
            due += self.interval_s

    def _send(self, socks: dict[str, zmq.Socket], messages: list[tuple[str, Message]]) -> None:
        """Under the lock, so that :meth:`end` returns only once no send of the step is on the
        way. Never blocks: a peer that is not reading just misses a keepalive."""
        for addr, msg in messages:
            sock = socks.get(addr)
            if sock is None:
                sock = socks[addr] = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, SEND_HWM)
                if self.configure is not None:
                    self.configure(sock)
                sock.connect(addr)
            try:
                sock.send(encode(msg), zmq.NOBLOCK)
                self.num_sent += 1
            except zmq.ZMQError as exc:  # the peer's own deadline covers it
                logger.warning("keepalive to %s during a step not sent: %s", addr, exc)
