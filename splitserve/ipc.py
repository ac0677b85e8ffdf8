"""ZeroMQ plumbing shared by workers and the server: one bound PULL inbox per process, and PUSH
sockets to peers by address. Every message is multipart: a msgspec header frame (see
``splitserve.messages``) followed by zero or more raw frames (KV pages). Nothing is unpickled:
a header that does not decode as a known message is dropped with a warning.
"""

from __future__ import annotations

import logging
import socket

import msgspec
import zmq

from splitserve.messages import Message, decode, encode

logger = logging.getLogger(__name__)

# Bounded queues: a peer that stops reading makes sends fail fast instead of growing memory.
SEND_HWM = 10_000


def free_tcp_addr(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` address with a port that was free a moment ago."""
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
        if curve is not None:  # splitserve.security.CurveKeys
            from splitserve.security import apply_curve_server

            apply_curve_server(self.sock, curve)
        self.sock.bind(addr)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def recv(self) -> tuple[Message, list[zmq.Frame]] | None:
        """Receive one message without blocking; None when the inbox is empty or the message is
        malformed (logged and dropped)."""
        try:
            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            return decode(parts[0].buffer), parts[1:]
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("dropped a malformed message on %s: %s", self.addr, exc)
            return None

    def close(self) -> None:
        self.sock.close(0)


class Outbox:
    """PUSH sockets to peers, connected on first use."""

    def __init__(self, ctx: zmq.Context, curve=None) -> None:
        self.ctx = ctx
        self.curve = curve  # splitserve.security.CurveKeys, or None
        self.socks: dict[str, zmq.Socket] = {}

    def _sock(self, addr: str) -> zmq.Socket:
        sock = self.socks.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            if self.curve is not None:
                from splitserve.security import apply_curve_client

                apply_curve_client(sock, self.curve)
            sock.connect(addr)
            self.socks[addr] = sock
        return sock

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
        sock = self.socks.pop(addr, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()
