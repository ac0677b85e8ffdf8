"""What crosses a process boundary: the message union, ZeroMQ sockets, raw frames, CURVE."""
