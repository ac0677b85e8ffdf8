"""The prefill side of a KV handoff: one :class:`SendSession` per request (states:
:class:`~splitserve.kv_transfer.session.TransferState`).

Prefill starts as soon as the task arrives; the decode worker's ``KVBootstrap`` (where the pages
go) may come before or after it. A request whose bootstrap does not come within
``transfer_timeout_s`` fails and its pages are freed; each ``KVQueued`` (the decode worker has no
room yet and still waits for this request) restarts that timer, until the bootstrap comes.

Overlap: after every scheduler step each bootstrapped request's newly completed pages are sent
at once (``KVPages`` with ``last=False``), so when the first token is sampled only the last piece
is still to go. Until then a ``KVKeepalive`` goes out every third of the timeout without other
news (and once at the bootstrap, as its acknowledgement): the decode worker's stall timer
restarts on every message, so a long prefill queue is not a stall there. After the last send the
pages stay held (``DRAINING``) until the backend no longer reads them (zmq sends straight from
the pool), at most ``transfer_timeout_s``; then the peer's queue is dropped and they are freed.

A decode worker that gives up sends ``KVFailed``; with a one-sided backend it names an
``ack_addr`` and keeps the request's pages fenced until this side answers ``KVReleased``
(``RELEASING``): sent once the request is dropped here and no write of it is in flight
(:meth:`~splitserve.kv_transfer.base.BaseKVSender.is_done`), or never, when that takes longer
than the timeout (the decode side's own deadline rules then). Early-chunk pages of a request
that fails here are freed at once: the pool outlives every send, so at worst stale bytes reach a
request that is gone; writes not yet started are skipped (``BaseKVSender.cancel``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from splitserve.engine.kv_pool import pages_for
from splitserve.engine.sched.request import Req
from splitserve.ipc.messages import (
    FailureKind,
    KVBootstrap,
    KVFailed,
    KVKeepalive,
    KVReleased,
    Message,
)
from splitserve.ipc.sockets import PeerUnreachable
from splitserve.kv_transfer.base import BaseKVSender
from splitserve.kv_transfer.send_transitions import SEND_TRANSITIONS
from splitserve.kv_transfer.send_transitions import SendEvent as E
from splitserve.kv_transfer.session import (
    BaseSession,
    SessionContext,
    SessionTable,
    TransferState,
)

logger = logging.getLogger(__name__)

T = TransferState


class SendPort(Protocol):
    """What a prefill-side session does to the world (the prefill worker; fakes in tests)."""

    def send(self, addr: str, msg: Message) -> None:
        """Send a control message. Raises: PeerUnreachable."""

    def release(self, req: Req) -> None:
        """Give back all ``req`` holds here: its grammar compile, and its place in the scheduler
        with its pages (queued, computing, or held for the send: ``SENDING_KV``); the scheduler
        frees them. Called at most once per request."""

    def fail(self, rid: str, reply_addr: str, message: str, code: int,
             kind: FailureKind) -> None:
        """Report ``rid``'s failure (``kind``) to the server at ``reply_addr``."""


class SendSession(BaseSession):
    """One request on the prefill worker, from its task or bootstrap (whichever comes first)
    to the release of its pages. Made by :class:`SendSessions`; the worker calls one method
    per event. ``req`` is the request while this session holds it (None once released);
    ``reply_addr`` where its failure is reported ("" until the task came)."""

    _ctx: SendContext

    def __init__(self, rid: str, state: TransferState, ctx: SendContext) -> None:
        super().__init__(rid, state, ctx, SEND_TRANSITIONS)
        self.req: Req | None = None
        self.reply_addr = ""
        self.bootstrap: KVBootstrap | None = None
        self.num_pages_sent = 0  # leading prompt pages shipped (early chunks)
        self.last_progress = 0.0  # when the decode worker last heard of this request
        self.ack_addr = ""  # RELEASING: where KVReleased goes

    # ---- events -------------------------------------------------------------------------------

    def on_task(self, req: Req) -> None:
        """The task came after the bootstrap: start computing (the worker schedules ``req``)."""
        nxt = self._next(E.TASK)
        if nxt is T.RELEASING:
            return  # failed already: the late task is dropped
        self.req, self.reply_addr = req, req.reply_addr
        self._enter(nxt, timed=False)

    def on_bootstrap(self, boot: KVBootstrap) -> None:
        """The decode worker reserved ``boot.page_ids``: acknowledge and send what is ready."""
        nxt = self._next(E.BOOTSTRAP)
        if nxt is T.RELEASING:
            return
        self.bootstrap = boot
        self._keepalive(self._now())  # the ack: the decode worker now waits on our progress
        if nxt is T.DRAINING:
            self._send_rest()
            return
        self._enter(nxt, timed=False)
        self.send_computed_pages()

    def on_queued(self) -> None:
        """``KVQueued``: not a stall; before the bootstrap its deadline restarts."""
        if self._next(E.QUEUED) in (T.BOOTSTRAPPING, T.PREFILLED):
            self._restart_deadline()

    def send_computed_pages(self) -> None:
        """Ship the complete pages that chunked prefill produced since the last call."""
        self._next(E.PAGES_COMPUTED)
        req = self.req
        complete = min(req.kv_len, req.prompt_len) // self._ctx.page_size
        if complete > self.num_pages_sent:
            self._send(complete, last=False)

    def on_prefilled(self) -> None:
        """The first token was sampled: the pages are this session's now; send the rest when
        bootstrapped."""
        nxt = self._next(E.PREFILLED)
        if nxt is T.PREFILLED:
            self._enter(nxt)  # still waiting for the same bootstrap: same deadline
        else:
            self._send_rest()

    def keep_alive(self, now: float) -> None:
        """Bootstrapped and still computing: a ``KVKeepalive`` if nothing went out for a third
        of the timeout. Nothing in other states."""
        if self.state not in (T.WAITING_FOR_TASK, T.TRANSFERRING):
            return
        if now - self.last_progress > self._ctx.timeout_s / 3:
            self._keepalive(now)

    def step_keepalive(self) -> tuple[str, Message] | None:
        """Bootstrapped and still computing: ``(the decode worker's inbox, KVKeepalive)`` for
        the worker to repeat while one long step runs (``worker.step_keepalive``); None in
        other states."""
        if self.state not in (T.WAITING_FOR_TASK, T.TRANSFERRING) or self.bootstrap is None:
            return None
        return self.bootstrap.dst_addr, KVKeepalive(self.rid)

    def poll(self) -> None:
        """``DRAINING`` / ``RELEASING``: act once the backend is done with the request's pages
        (free them; answer ``KVReleased``)."""
        nxt = self._next(E.DRAINED)
        if not self._ctx.sender.is_done(self.rid):
            return
        self._release()
        if self.state is T.RELEASING:
            self._tell(self.ack_addr, KVReleased(self.rid))
        self._enter(nxt)

    def on_kv_failed(self, ack_addr: str = "") -> None:
        """The decode worker gave up (it has told the server). ``ack_addr``: it keeps the pages
        fenced until this side answers ``KVReleased`` there."""
        nxt = self._next(E.KV_FAILED_ACK if ack_addr else E.KV_FAILED)
        if self.state is T.RELEASING:
            return
        self._ctx.sender.cancel(self.rid)
        if self.state is not T.DRAINING:  # a sent request keeps its pages until it is read
            self._release()
        if nxt is T.RELEASING:
            self.ack_addr = ack_addr
            self._enter(nxt, timed=True)
            self.poll()
        elif nxt is not self.state:
            self._enter(nxt)

    def abort(self) -> None:
        """The server aborted it: stop computing and sending; free what the backend no longer
        reads."""
        nxt = self._next(E.ABORT)
        if self.state is T.RELEASING:
            return
        self._ctx.sender.cancel(self.rid)
        if nxt is T.FAILED:
            self._release()
            self._enter(nxt)

    def fail(self, message: str, code: int = 500, notify: str | None = None,
             kind: FailureKind = FailureKind.TRANSFER) -> None:
        """It failed here: free its pages, report ``message`` (``code``, ``kind``) to the server
        and, when bootstrapped, tell the decode worker (``notify``: its ``KVFailed`` message, with
        ``kind``) so it frees its reservation now rather than at its deadline."""
        if self._next(E.FAIL) is not T.FAILED:
            return  # after the last send a failure here changes nothing
        self._ctx.sender.cancel(self.rid)
        self._release()
        self._enter(T.FAILED)
        if self.reply_addr:
            self._ctx.port.fail(self.rid, self.reply_addr, message, code, kind)
        if notify is not None and self.bootstrap is not None:
            self._tell(self.bootstrap.dst_addr, KVFailed(self.rid, notify, kind=kind.value))

    def time_out(self) -> None:
        nxt = self._next(E.TIMEOUT)
        timeout_s = self._ctx.timeout_s
        if self.state is T.WAITING_FOR_TASK:
            self._enter(nxt)  # a bootstrap whose task never came: nothing is held
        elif self.state in (T.BOOTSTRAPPING, T.PREFILLED):
            self.fail(f"KV transfer timed out: no decode worker bootstrap within {timeout_s:g} s")
        elif self.state is T.DRAINING:
            logger.warning("KV send of %s to %s not done after %g s: dropping what is queued",
                           self.rid, self.bootstrap.dst_addr, timeout_s)
            self._ctx.sender.cancel_peer(self.bootstrap.dst_addr)
            self._release()
            self._enter(nxt)
        else:  # RELEASING
            logger.warning("KV writes of %s still in flight after %g s; not acknowledging",
                           self.rid, timeout_s)
            if self.req is not None:  # came from DRAINING: its pages are still held
                self._ctx.sender.cancel_peer(self.bootstrap.dst_addr)
                self._release()
            self._enter(nxt)

    # ---- helpers ------------------------------------------------------------------------------

    def _send(self, end: int, last: bool) -> bool:
        """Send prompt pages ``[num_pages_sent, end)``; False (and FAILED) on failure."""
        req, boot = self.req, self.bootstrap
        start = self.num_pages_sent
        try:
            if len(boot.page_ids) < end:
                raise ValueError(f"decode reserved {len(boot.page_ids)} pages, prompt needs {end}")
            self._ctx.sender.send(
                boot, req.page_ids[start:end], boot.page_ids[start:end], last=last,
                first_token=req.output_ids[0] if last else -1,
                first_logprob=req.output_logprobs[0] if last else 0.0,
                finished=last and req.finish_reason is not None,
            )
        except (PeerUnreachable, ValueError) as exc:
            self.fail(f"KV transfer failed: {exc}",
                      notify=f"prefill worker: KV transfer failed: {exc}")
            return False
        self.num_pages_sent = end
        self.last_progress = self._now()
        return True

    def _send_rest(self) -> None:
        """Send the last message (every page not yet sent, and the first token), then drain.
        A request that ended with its first token needs no more pages (the decode side frees
        the ones it got)."""
        req = self.req
        n = self.num_pages_sent if req.finish_reason else pages_for(req.prompt_len,
                                                                    self._ctx.page_size)
        if not self._send(n, last=True):
            return
        self._enter(T.DRAINING, timed=True)
        self.poll()

    def _keepalive(self, now: float) -> None:
        self._tell(self.bootstrap.dst_addr, KVKeepalive(self.rid))
        self.last_progress = now

    def _release(self) -> None:
        """Give the request back to the worker, once."""
        req, self.req = self.req, None
        if req is not None:
            self._ctx.port.release(req)

    def _tell(self, addr: str, msg: Message) -> None:
        try:
            self._ctx.port.send(addr, msg)
        except PeerUnreachable as exc:  # the peer's own deadline covers it
            logger.warning("%s for %s not delivered: %s", type(msg).__name__, self.rid, exc)


@dataclass(frozen=True, slots=True)
class SendContext(SessionContext):
    """What the prefill side's sessions share: ``sender`` (the KV backend's: ``send``,
    ``is_done``, ``cancel``, ``cancel_peer``), ``port`` (:class:`SendPort`), ``page_size``
    (tokens per KV page)."""

    sender: BaseKVSender
    port: SendPort
    page_size: int


class SendSessions(SessionTable[SendSession]):
    """The prefill worker's sessions by rid.

    Args:
        sender, port, page_size: see :class:`SendContext`.
        timeout_s, clock: see :class:`~splitserve.kv_transfer.session.SessionContext`.
    """

    def __init__(self, sender: BaseKVSender, port: SendPort, page_size: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.ctx = SendContext(timeout_s, clock, sender, port, page_size)

    def open_task(self, req: Req) -> SendSession:
        """A session for a task that came first (``BOOTSTRAPPING``)."""
        s = SendSession(req.rid, T.BOOTSTRAPPING, self.ctx)
        s.req, s.reply_addr = req, req.reply_addr
        s._restart_deadline()
        return self._add(s)

    def open_bootstrap(self, boot: KVBootstrap) -> SendSession:
        """A session for a bootstrap that came before its task (``WAITING_FOR_TASK``); the
        bootstrap is acknowledged at once."""
        s = SendSession(boot.rid, T.WAITING_FOR_TASK, self.ctx)
        s.bootstrap = boot
        s._restart_deadline()
        s._keepalive(self.ctx.clock())
        return self._add(s)

    def open_release(self, rid: str, ack_addr: str) -> SendSession:
        """A ``KVFailed`` with ``ack_addr`` for a request with no session (finished, failed or
        never seen): acknowledged as soon as no write of it is in flight (at once, usually)."""
        s = self._add(SendSession(rid, T.RELEASING, self.ctx))
        s.ack_addr = ack_addr
        s._restart_deadline()
        s.poll()
        return s
