"""What a worker's role policy does to the world: the typed actions it issues, as a small port.

A policy (``prefill.policy``, ``decode.policy``, ``worker.colocated``) never touches a socket:
it sends a control message, emits token outputs, or fails a request with a
:class:`~splitserve.ipc.messages.FailureKind`, through a :class:`WorkerPort`, and reads the time
from it. :class:`OutboxPort` is the worker's, over its ZeroMQ outbox (tests use it over a fake
outbox). :class:`SessionPort` is what the KV transfer sessions of a worker act through: the
same sends and failures, and a request's pages given back through the scheduler, which owns
them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from splitserve.ipc.messages import (
    FailureKind,
    KVPages,
    Message,
    RequestError,
    TokenBatch,
    TokenOutput,
)
from splitserve.ipc.sockets import PeerUnreachable

if TYPE_CHECKING:
    from splitserve.engine.sched.request import Req
    from splitserve.engine.sched.scheduler import Scheduler
    from splitserve.ipc.frames import Frames
    from splitserve.ipc.sockets import Outbox
    from splitserve.kv_transfer.base import BaseKVReceiver
    from splitserve.worker.grammars import WorkerGrammars
    from splitserve.worker.tracing import WorkerTracer

logger = logging.getLogger(__name__)


class WorkerPort(Protocol):
    """The actions a role policy issues (the worker's :class:`OutboxPort`; fakes in tests)."""

    def now(self) -> float:
        """Seconds on the worker's clock (monotonic; every deadline is read from it)."""

    def send(self, addr: str, msg: Message, frames: list | tuple = ()) -> None:
        """Send a control message to the inbox at ``addr``. Raises: PeerUnreachable."""

    def emit(self, outputs: list[tuple[str, TokenOutput]]) -> None:
        """Send token outputs to the routers they name (``(reply_addr, output)``), one
        ``TokenBatch`` per router; a router that is not reading loses them (logged)."""

    def fail(self, rid: str, reply_addr: str, message: str, code: int,
             kind: FailureKind) -> None:
        """Report that request ``rid`` failed here (``code``: an HTTP status) to the router at
        ``reply_addr``, and count it by ``kind``."""

    def link_drops(self, addr: str) -> int:
        """How often the link to ``addr`` dropped (``Outbox.link_drops``)."""


class OutboxPort:
    """The worker's port over its ZeroMQ outbox, and the counters of what it reported.

    Args:
        outbox: the worker's outbox (``ipc.sockets.Outbox``).
        clock: seconds, monotonic; :attr:`clock` may be replaced later (tests freeze it).
    """

    def __init__(self, outbox: Outbox, clock: Callable[[], float] = time.monotonic) -> None:
        self.outbox = outbox
        self.clock = clock
        self.num_failed = 0  # requests failed here, every kind
        self.num_transfer_failures = 0  # of those, FailureKind.TRANSFER
        self.num_orphaned = 0  # requests ended because their router went away
        self.num_tokens_out = 0  # output tokens sent to routers
        # The traced requests' spans (worker.tracing.WorkerTracer; None: tracing off). A
        # request that fails or is orphaned here ends its trace through the port.
        self.tracer: WorkerTracer | None = None

    def now(self) -> float:
        """Seconds on :attr:`clock`."""
        return self.clock()

    def send(self, addr: str, msg: Message, frames: list | tuple = ()) -> None:
        """Send ``msg`` (and raw ``frames``) to ``addr``. Raises: PeerUnreachable."""
        self.outbox.send(addr, msg, frames)

    def emit(self, outputs: list[tuple[str, TokenOutput]]) -> None:
        """Send token outputs, one :class:`TokenBatch` per router address."""
        by_addr: dict[str, list[TokenOutput]] = {}
        num_tokens = 0
        for addr, out in outputs:
            by_addr.setdefault(addr, []).append(out)
            num_tokens += len(out.token_ids)
        self.num_tokens_out += num_tokens
        for addr, outs in by_addr.items():
            try:
                self.send(addr, TokenBatch(outs))
            except PeerUnreachable as exc:
                logger.warning("dropping %d outputs: %s", len(outs), exc)

    def fail(self, rid: str, reply_addr: str, message: str, code: int,
             kind: FailureKind) -> None:
        """Count the failure and send :class:`RequestError` (with ``kind``) to ``reply_addr``."""
        logger.info("request %s failed (%s): %s", rid, kind.value, message)
        self.num_failed += 1
        if self.tracer is not None:
            self.tracer.end(rid, "failed", error=message)
        if kind is FailureKind.TRANSFER:
            self.num_transfer_failures += 1
        try:
            self.send(reply_addr, RequestError(rid, message, code, kind.value))
        except PeerUnreachable as exc:
            logger.warning("could not report failure of %s: %s", rid, exc)

    def orphan(self, rid: str, reply_addr: str, message: str) -> None:
        """Count a request ended because its router went away, and tell that router (503), in
        case it was only cut off and its link comes back."""
        self.num_orphaned += 1
        if self.tracer is not None:
            self.tracer.end(rid, "orphaned", error=message)
        try:
            self.send(reply_addr, RequestError(rid, message, 503,
                                               FailureKind.ROUTER_GONE.value))
        except PeerUnreachable:
            pass

    def link_drops(self, addr: str) -> int:
        """How often the link to ``addr`` dropped."""
        return self.outbox.link_drops(addr)


class SessionPort:
    """What a worker's KV transfer sessions act through (both ``SendPort`` and ``RecvPort``):
    sends, failures and link drops through the worker's port; a request's pages given back
    through the scheduler (which owns every page: ``Scheduler.release``), its compile dropped;
    received pages installed by the KV receiver.

    Args:
        port: the worker's port.
        scheduler: the worker's scheduler.
        grammars: the worker's grammar compiles (``worker.grammars.WorkerGrammars``).
        receiver: the KV receiver (decode worker), None elsewhere.
    """

    def __init__(self, port: WorkerPort, scheduler: Scheduler, grammars: WorkerGrammars,
                 receiver: BaseKVReceiver | None = None) -> None:
        self.port = port
        self.scheduler = scheduler
        self.grammars = grammars
        self.receiver = receiver

    def send(self, addr: str, msg: Message) -> None:
        """Send a control message. Raises: PeerUnreachable."""
        self.port.send(addr, msg)

    def fail(self, rid: str, reply_addr: str, message: str, code: int,
             kind: FailureKind) -> None:
        """Report ``rid``'s failure to the router at ``reply_addr``."""
        self.port.fail(rid, reply_addr, message, code, kind)

    def link_drops(self, addr: str) -> int:
        """How often the link to ``addr`` dropped."""
        return self.port.link_drops(addr)

    def release(self, req: Req) -> None:
        """Give back all ``req`` holds: its compile, its place in the scheduler, its pages."""
        self.grammars.discard(req.rid)
        self.scheduler.release(req)
        tracer = getattr(self.port, "tracer", None)
        if tracer is not None:
            tracer.end(req.rid, "released", req)

    def install(self, header: KVPages, frames: Frames | list) -> None:
        """Put one message's pages into the pool. Raises: ValueError (they do not fit)."""
        self.receiver.install(header, frames)
