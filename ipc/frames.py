"""The raw frames that follow a message header, read one at a time into memory the reader picks.

ZeroMQ delivers a multipart message whole, so once :class:`splitserve.ipc.sockets.Inbox` has received a
header frame, every frame after it is already queued in the socket. :class:`SocketFrames` leaves
them there until the consumer, having checked the header, says where each one goes:
``read_into(buf)`` copies a frame straight from ZeroMQ's buffer into ``buf`` (e.g. the destination
pages of a KV pool: one copy, no Python object per frame), ``read()`` returns it as a
``zmq.Frame``. :class:`FrameList` offers the same interface over frames already in memory (tests,
in-process callers). Frames nobody read are discarded before the inbox receives the next message.
"""

from __future__ import annotations

import zmq


class SocketFrames:
    """The unread frames of the message ``sock`` is in the middle of.

    Valid until the next receive on ``sock`` (the inbox discards what is left first).
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._more = bool(sock.getsockopt(zmq.RCVMORE))

    @property
    def more(self) -> bool:
        """Whether a frame is left to read."""
        return self._more

    def read_into(self, buf: memoryview) -> int:
        """Copy the next frame into ``buf`` (contiguous, writable).

        Returns:
            The frame's size in bytes. Larger than ``buf``: only ``len(buf)`` bytes were written
            (the rest is dropped); smaller: only that many were written.

        Raises:
            ValueError: no frame is left.
        """
        if not self._more:
            raise ValueError("no frame left in this message")
        size = self._sock.recv_into(buf, flags=zmq.NOBLOCK)
        self._more = bool(self._sock.getsockopt(zmq.RCVMORE))
        return size

    def read(self) -> memoryview:
        """The next frame's bytes (a view of ZeroMQ's buffer, no copy).

        Raises:
            ValueError: no frame is left.
        """
        if not self._more:
            raise ValueError("no frame left in this message")
        frame = self._sock.recv(zmq.NOBLOCK, copy=False)
        self._more = bool(self._sock.getsockopt(zmq.RCVMORE))
        return frame.buffer

    def discard(self) -> int:
        """Drop every frame left; returns how many there were."""
        n = 0
        while self._more:
            self._sock.recv_into(bytearray(), flags=zmq.NOBLOCK)
            self._more = bool(self._sock.getsockopt(zmq.RCVMORE))
            n += 1
        return n


class FrameList:
    """:class:`SocketFrames`' interface over frames already in memory (``bytes``, memoryviews,
    ``zmq.Frame``)."""

    def __init__(self, frames: list | tuple) -> None:
        self._frames = list(frames)
        self._next = 0

    @property
    def more(self) -> bool:
        return self._next < len(self._frames)

    def read(self) -> memoryview:
        if not self.more:
            raise ValueError("no frame left in this message")
        frame = self._frames[self._next]
        self._next += 1
        return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)

    def read_into(self, buf: memoryview) -> int:
        src = self.read().cast("B")
        dst = memoryview(buf).cast("B")
        n = min(src.nbytes, dst.nbytes)
        dst[:n] = src[:n]
        return src.nbytes

    def discard(self) -> int:
        n = len(self._frames) - self._next
        self._next = len(self._frames)
        return n


Frames = SocketFrames | FrameList


def as_frames(frames: Frames | list | tuple) -> Frames:
    """``frames`` as a :class:`SocketFrames` / :class:`FrameList` (lists are wrapped)."""
    return frames if isinstance(frames, SocketFrames | FrameList) else FrameList(frames)
