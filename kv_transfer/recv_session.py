"""The decode side of a KV handoff: one :class:`RecvSession` per request (states:
:class:`~splitserve.kv_transfer.session.TransferState`), from the task to the scheduler.

Admission control: a request is bootstrapped only when the scheduler reserved its prompt's
pages (``Scheduler.admit_waiting_for_kv``: ``can_admit``, in arrival order); until then it is
``QUEUED`` and tells the prefill worker so (``KVQueued``) every third of ``transfer_timeout_s``:
each one delivered restarts the request's deadline there and here, so only a prefill worker
that is unreachable, or whose link dropped since the task came (it restarted or left, and the
prompt's KV with it), times a queued request out. Once bootstrapped, every message of the request (pages or
``KVKeepalive``) restarts the deadline: a stall is silence from the prefill worker, not a long
queue there. On expiry the request fails (504) and its pages are freed.

Fences (one-sided backends: shm, mooncake, nixl). There the prefill worker writes straight into
this worker's pool, so when a request fails here before its last ``KVPages`` arrived its
reserved pages cannot be reused at once: a write may still be on its way. The session sends
``KVFailed`` with an ``ack_addr``; the prefill worker stops writing that request (skipping queued
writes, waiting out the one in flight) and answers ``KVReleased``. Only then are the pages freed:
exact, whatever the prefill worker's speed. Without an answer the pages stay ``FENCED`` until one
of two things:

- the prefill worker is known gone: this worker's ZeroMQ link to it dropped after the bootstrap
  was sent (``Outbox.link_drops``; the same signal the router uses to declare a worker dead). A
  dead process writes nothing, so its pages are freed at once;
- the deadline passes (the transfer timeout after the failure). This covers a prefill worker that
  is hung with its link up (SIGSTOP, a stuck step). If it wakes up later and finishes a write it
  had started, that write lands in reused pages: a time bound, not a guarantee, like the fixed
  3 s quarantine this replaced, but 10x longer by default and only for a worker that stopped
  answering. Holding the pages for ever instead would leak them on every hung worker.
  Caveat: between hosts, a link drop while the process lives (a network partition) is taken for
  a dead worker too; its one-sided writes would then have to cross the same partition.

A fenced session ignores everything but those three: ``FAILED`` and ``FENCED`` always win over
late messages. With the zmq backend nothing writes into the pool but the receiver, so a failed
request's pages are freed at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from splitserve.engine.sched.request import Req
from splitserve.ipc.frames import Frames
from splitserve.ipc.messages import FailureKind, KVBootstrap, KVFailed, KVPages, KVQueued, Message
from splitserve.ipc.sockets import PeerUnreachable
from splitserve.kv_transfer.recv_transitions import (
    RECV_TRANSITIONS,
    RECV_TRANSITIONS_ONE_SIDED,
)
from splitserve.kv_transfer.recv_transitions import RecvEvent as E
from splitserve.kv_transfer.session import (
    BaseSession,
    SessionContext,
    SessionTable,
    TransferState,
)

logger = logging.getLogger(__name__)

T = TransferState


class RecvPort(Protocol):
    """What a decode-side session does to the world (the decode worker; fakes in tests)."""

    def send(self, addr: str, msg: Message) -> None:
        """Send a control message. Raises: PeerUnreachable."""

    def install(self, header: KVPages, frames: Frames | list) -> None:
        """Put one message's pages into the pool (``BaseKVReceiver.install``).
        Raises: ValueError (the frames do not match the header or the pool)."""

    def release(self, req: Req) -> None:
        """Take ``req`` out of the scheduler (``WAITING_FOR_KV``: queued, or its pages reserved)
        and free its pages. Called at most once per request, never after a hand-over."""

    def link_drops(self, addr: str) -> int:
        """How often the link to ``addr`` dropped (``Outbox.link_drops``)."""

    def fail(self, rid: str, reply_addr: str, message: str, code: int,
             kind: FailureKind) -> None:
        """Report ``rid``'s failure (``kind``) to the server at ``reply_addr``."""


class RecvSession(BaseSession):
    """One request on the decode worker until its KV is installed and it is handed to the
    scheduler (:meth:`start`), or it failed and its pages are free. Made by
    :class:`RecvSessions`. ``req`` is the request while this session holds it (None once
    released or handed over); its ``page_ids`` are the reservation."""

    _ctx: RecvContext

    def __init__(self, req: Req, prefill_addr: str, ctx: RecvContext) -> None:
        transitions = RECV_TRANSITIONS_ONE_SIDED if ctx.one_sided else RECV_TRANSITIONS
        super().__init__(req.rid, T.QUEUED, ctx, transitions)
        self.req: Req | None = req
        self.reply_addr = req.reply_addr
        self.prefill_addr = prefill_addr
        # Outbox.link_drops(prefill_addr) at the task, then at the bootstrap: a larger count
        # means the prefill worker has gone since.
        self.link_drops = ctx.port.link_drops(prefill_addr)
        self.last_keepalive = ctx.clock()  # when the last KVQueued went out
        self.reserved: frozenset[int] = frozenset()  # checked against every KVPages

    # ---- events -------------------------------------------------------------------------------

    def keep_alive(self, now: float) -> None:
        """``QUEUED``: tell the prefill worker it still waits here (``KVQueued``) once per third
        of the timeout; delivered, it restarts the deadline. Not once the link to the prefill
        worker dropped: it lost the prompt's KV, so the deadline runs out. Nothing in other
        states."""
        if self.state is not T.QUEUED or now - self.last_keepalive < self._ctx.timeout_s / 3:
            return
        if self._ctx.port.link_drops(self.prefill_addr) > self.link_drops:
            return
        self.last_keepalive = now
        try:
            self._ctx.port.send(self.prefill_addr, KVQueued(self.rid))
        except PeerUnreachable as exc:  # its deadline runs on
            logger.warning("queued keepalive for %s not delivered: %s", self.rid, exc)
            return
        self.deadline = now + self._ctx.timeout_s

    def reserve(self, page_ids: list[int], boot: KVBootstrap) -> None:
        """Pages ``page_ids`` are reserved for the prompt: send ``boot`` (which names them)."""
        nxt = self._next(E.RESERVE)
        self.req.page_ids = list(page_ids)
        self.reserved = frozenset(page_ids)
        self.link_drops = self._ctx.port.link_drops(self.prefill_addr)
        self._enter(nxt, timed=True)
        self._tell(boot)

    def on_keepalive(self) -> None:
        """``KVKeepalive``: the prefill worker is alive; a receiving deadline restarts."""
        if self._next(E.KEEPALIVE) is T.WAITING_FOR_PAGES:
            self._restart_deadline()

    def on_pages(self, header: KVPages, frames: Frames | list) -> None:
        """Install one message's pages (checked against the reservation first, so nothing is
        written outside it). The last one records the first token (``KV_READY``), or frees the
        pages when that token ended the request (``DONE``: the prefill worker reported it)."""
        event = E.PAGES if not header.last else E.FINISHED if header.finished else E.LAST_PAGES
        nxt = self._next(event)
        if self.state is not T.WAITING_FOR_PAGES:
            return  # late: ignored
        self._restart_deadline()
        try:
            if not self.reserved.issuperset(header.page_ids):
                raise ValueError("pages outside the request's reservation")
            self._ctx.port.install(header, frames)
        except ValueError as exc:
            self.fail(f"decode worker: KV transfer failed: {exc}", notify=True,
                      error=f"KV transfer failed: {exc}")
            return
        if event is E.FINISHED:
            self._release()
        elif event is E.LAST_PAGES:
            req = self.req
            # Its alternatives went to the server from the prefill worker: none kept here.
            req.append_output(header.first_token, header.first_logprob)
            req.kv_len = req.prompt_len
            req.emitted_len = 1
        if nxt is not self.state:
            self._enter(nxt, timed=False)

    def start(self) -> Req:
        """Hand the request, its KV installed, to the caller (who gives it to the scheduler)."""
        self._enter(self._next(E.START))
        req, self.req = self.req, None
        return req

    def on_kv_failed(self, message: str, kind: FailureKind = FailureKind.TRANSFER) -> None:
        """``KVFailed`` from the prefill worker: the request fails here with its message and
        ``kind`` (reported from here too; the server keeps the first error it gets)."""
        if self._next(E.KV_FAILED) is not self.state:
            self.fail(message, notify=False, error=message, kind=kind)

    def fail(self, reason: str, *, notify: bool, error: str | None = None, code: int = 500,
             kind: FailureKind = FailureKind.TRANSFER) -> None:
        """It failed: free or fence its pages, and report ``error`` (``code``, ``kind``) to the
        server (None: it knows already).

        ``reason``: the ``KVFailed`` message for the prefill worker, told only while its KV
        is still on the way, so it stops computing and sending now rather than at its own
        deadline: when ``notify``, and always with a one-sided backend, which then also asks
        for the acknowledgement that ends the fence.
        """
        nxt = self._next(E.FAIL)
        if nxt is self.state:
            return  # fenced already
        if self.state is T.WAITING_FOR_PAGES and (notify or nxt is T.FENCED):
            self._tell(KVFailed(self.rid, reason, self._ctx.addr if nxt is T.FENCED else ""))
        if nxt is T.FENCED:
            self._enter(nxt, timed=True)
        else:
            self._release()
            self._enter(nxt)
        if error is not None:
            self._ctx.port.fail(self.rid, self.reply_addr, error, code, kind)

    def abort(self) -> None:
        """The server aborted it (and the prefill worker too: it is told only to end a fence)."""
        if self._next(E.ABORT) is not self.state:
            self.fail("aborted", notify=False)

    def on_released(self) -> None:
        """``KVReleased``: the prefill worker writes no more; a fence ends."""
        if self._next(E.RELEASED) is T.FAILED:
            self._end_fence()

    def check_link(self) -> None:
        """``FENCED``: free the pages at once if the prefill worker is gone (link dropped)."""
        if self.state is not T.FENCED:
            return
        if self._ctx.port.link_drops(self.prefill_addr) > self.link_drops:
            logger.info("prefill worker %s is gone (link dropped): freeing the %d fenced pages "
                        "of %s", self.prefill_addr, len(self.req.page_ids), self.rid)
            self._next(E.LINK_DROPPED)
            self._end_fence()

    def time_out(self) -> None:
        self._next(E.TIMEOUT)
        timeout_s = self._ctx.timeout_s
        if self.state is T.FENCED:
            logger.warning("no KVReleased from prefill worker %s for %s within %g s: freeing "
                           "its %d pages", self.prefill_addr, self.rid, timeout_s,
                           len(self.req.page_ids))
            self._end_fence()
            return
        stage = "receiving KV pages" if self.state is T.WAITING_FOR_PAGES else "reserving KV pages"
        # Tell the prefill side too, so it frees its copy now rather than at its deadline.
        self.fail("decode worker timed out", notify=True,
                  error=f"KV transfer timed out {stage} after {timeout_s:g} s", code=504)

    # ---- helpers ------------------------------------------------------------------------------

    def _end_fence(self) -> None:
        self._release()
        self._enter(T.FAILED)

    def _release(self) -> None:
        req, self.req = self.req, None
        if req is not None:
            self._ctx.port.release(req)

    def _tell(self, msg: Message) -> None:
        try:
            self._ctx.port.send(self.prefill_addr, msg)
        except PeerUnreachable as exc:  # then its deadline (or the fence's) covers it
            logger.warning("%s for %s not delivered: %s", type(msg).__name__, self.rid, exc)


@dataclass(frozen=True, slots=True)
class RecvContext(SessionContext):
    """What the decode side's sessions share: ``port`` (:class:`RecvPort`), ``one_sided`` (the
    backend writes into this pool itself, ``BaseKVReceiver.one_sided``: failed requests are
    fenced) and ``addr`` (this worker's inbox, where ``KVReleased`` comes:
    ``KVFailed.ack_addr``)."""

    port: RecvPort
    one_sided: bool
    addr: str


class RecvSessions(SessionTable[RecvSession]):
    """The decode worker's sessions by rid, in arrival order (the admission order).

    Args:
        port, one_sided, addr: see :class:`RecvContext`.
        timeout_s, clock: see :class:`~splitserve.kv_transfer.session.SessionContext`.
    """

    def __init__(self, port: RecvPort, one_sided: bool, addr: str, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.ctx = RecvContext(timeout_s, clock, port, one_sided, addr)

    def open(self, req: Req, prefill_addr: str) -> RecvSession:
        """A session for a new task, ``QUEUED`` until pages are reserved.

        Raises:
            ValueError: ``req.rid`` has a live session already (a fenced one, say).
        """
        s = RecvSession(req, prefill_addr, self.ctx)
        s._restart_deadline()
        return self._add(s)
