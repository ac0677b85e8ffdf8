"""ZeroMQ plumbing shared by workers and the server: one bound PULL inbox per process, and PUSH
sockets to peers by address. Every message is multipart: a msgspec header frame (see
``splitserve.ipc.messages``) followed by zero or more raw frames (KV pages). Nothing is unpickled:
a header that does not decode as a known message is dropped with a warning, with its frames.
The inbox hands out the raw frames unread (``splitserve.ipc.frames.SocketFrames``), so that a KV
receiver can check the header and then receive each frame straight into its pool.
"""

from __future__ import annotations

import logging
import random
import socket

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from splitserve.ipc.frames import SocketFrames
from splitserve.ipc.messages import Message, decode, encode

logger = logging.getLogger(__name__)

# Bounded queues: a peer that stops reading makes sends fail fast instead of growing memory.
SEND_HWM = 10_000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_tcp_addr(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` address with a port that was free a moment ago.

    The port is drawn below the kernel's ephemeral range where there is room (10000 up to it):
    a port the kernel hands out for ``bind(0)`` or an outgoing connection (UCX in a NIXL worker
    opens several) is then never the one a worker was told to bind a moment later. Falls back
    to a kernel-chosen port.
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64 if low > 10_000 else 0):
        port = rng.randrange(10_000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return f"tcp://{host}:{port}"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class PeerUnreachable(RuntimeError):
    """A send could not be queued: the peer's queue is full (it is gone or stuck)."""


class Inbox:
    """The process's bound PULL socket."""

    def __init__(self, ctx: zmq.Context, addr: str, curve=None) -> None:
        self.addr = addr
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:  # splitserve.ipc.security.CurveKeys
            from splitserve.ipc.security import apply_curve_server

            apply_curve_server(self.sock, curve)
        self.sock.bind(addr)
        self._frames: SocketFrames | None = None  # the last message's frames, maybe unread

    def _discard_unread(self) -> None:
        if self._frames is not None:
            self._frames.discard()
            self._frames = None

    def poll(self, timeout_ms: int) -> bool:
        self._discard_unread()  # else the unread frames would count as a new message
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def recv(self) -> tuple[Message, SocketFrames] | None:
        """Receive one message without blocking; None when the inbox is empty or the header is
        malformed (logged and dropped with its frames).

        Returns:
            The decoded header and its raw frames, still unread: read them before the next
            :meth:`recv` or :meth:`poll`, which discard what is left.
        """
        self._discard_unread()
        try:
            head = self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        frames = self._frames = SocketFrames(self.sock)
        try:
            return decode(head), frames
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("dropped a malformed message on %s: %s", self.addr, exc)
            self._discard_unread()
            return None

    def close(self) -> None:
        self.sock.close(0)


class Outbox:
    """PUSH sockets to peers, connected on first use.

    ``watch_links``: count each peer link's drops (ZeroMQ socket monitor), for
    :meth:`link_drops`. A dropped TCP or ipc link means the peer process closed it or is gone,
    the same signal the router uses to declare a worker dead.
    """

    def __init__(self, ctx: zmq.Context, curve=None, watch_links: bool = False) -> None:
        self.ctx = ctx
        self.curve = curve  # splitserve.ipc.security.CurveKeys, or None
        self.socks: dict[str, zmq.Socket] = {}
        self.watch_links = watch_links
        self._monitors: dict[str, zmq.Socket] = {}
        self._drops: dict[str, int] = {}

    def _sock(self, addr: str) -> zmq.Socket:
        sock = self.socks.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            if self.curve is not None:
                from splitserve.ipc.security import apply_curve_client

                apply_curve_client(sock, self.curve)
            if self.watch_links:  # before connecting, so that no event is missed
                self._monitors[addr] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(addr)
            self.socks[addr] = sock
        return sock

    def watch(self, addr: str) -> None:
        """Count the drops of the link to ``addr`` from now on (:meth:`link_drops`), whatever
        ``watch_links`` says; connects to ``addr`` if this outbox has not yet."""
        sock = self._sock(addr)
        if addr not in self._monitors:
            self._monitors[addr] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def link_drops(self, addr: str) -> int:
        """How many times an established link to ``addr`` dropped since this outbox first sent
        there (0 without ``watch_links``). Never blocks."""
        mon = self._monitors.get(addr)
        while mon is not None:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._drops[addr] = self._drops.get(addr, 0) + 1
        return self._drops.get(addr, 0)

    def _unwatch(self, addr: str) -> None:
        if addr not in self._monitors:
            return
        self.link_drops(addr)  # count what it saw so far
        self.socks[addr].disable_monitor()  # before its monitor socket goes
        self._monitors.pop(addr).close(0)

    def send(
        self, addr: str, msg: Message, frames: list | tuple = (), track: bool = False
    ) -> list[zmq.MessageTracker]:
        """Send ``msg`` (and raw ``frames``, sent without copying) to ``addr``.

        Returns:
            With ``track``, one tracker per frame: ``done`` once ZeroMQ no longer reads that
            frame's memory (it was written to the socket, or dropped by :meth:`reset`).

        Raises:
            PeerUnreachable: the peer's send queue is full.
        """
        sock = self._sock(addr)
        trackers = []
        try:
            if frames:
                sock.send(encode(msg), zmq.SNDMORE | zmq.NOBLOCK)
                for i, frame in enumerate(frames):
                    more = zmq.SNDMORE if i < len(frames) - 1 else 0
                    tracker = sock.send(frame, more, copy=False, track=track)
                    if track and tracker is not None:
                        trackers.append(tracker)
            else:
                sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again as exc:
            raise PeerUnreachable(f"peer {addr} is not reading (send queue full)") from exc
        return trackers

    def reset(self, addr: str) -> None:
        """Close the socket to ``addr`` discarding what it still queues (a new one is made on the
        next send)."""
        self._unwatch(addr)
        sock = self.socks.pop(addr, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for addr in list(self._monitors):
            self._unwatch(addr)
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()
