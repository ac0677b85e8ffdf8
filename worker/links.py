"""A worker's ZeroMQ side: its context, CURVE keys and authenticator, its inbox and outbox."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zmq

from splitserve.config import WorkerConfig
from splitserve.ipc.sockets import Inbox, Outbox


@dataclass(slots=True, eq=False)
class Links:
    """The sockets of one worker. ``curve``: its CURVE keys (``ipc.security.CurveKeys``) when
    the links are encrypted, else None; ``auth``: the authenticator thread that checks peers'
    keys, or None."""

    ctx: zmq.Context
    inbox: Inbox
    outbox: Outbox
    curve: Any = None
    auth: Any = None

    def configure_client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (a socket of this worker's context, e.g. the heartbeat's) a CURVE
        client when the links are encrypted."""
        if self.curve is not None:
            from splitserve.ipc.security import apply_curve_client

            apply_curve_client(sock, self.curve)

    def close(self) -> None:
        """Stop the authenticator, close both sockets and end the context."""
        if self.auth is not None:
            self.auth.stop()
        self.inbox.close()
        self.outbox.close()
        self.ctx.term()


def open_links(config: WorkerConfig, watch_links: bool) -> Links:
    """Bind the inbox at ``config.addr`` (CURVE when ``config.security.curve_keys`` names keys)
    and make the outbox; ``watch_links``: the outbox counts link drops to every peer it sends
    to (a decode worker watches its prefill workers: a dropped one frees its fenced pages)."""
    ctx = zmq.Context()
    curve = auth = None
    if config.security.curve_keys:
        from splitserve.ipc.security import CurveKeys, start_authenticator

        curve = CurveKeys.load(config.security.curve_keys)
        auth = start_authenticator(ctx, curve)
    inbox = Inbox(ctx, config.addr, curve)
    outbox = Outbox(ctx, curve, watch_links=watch_links)
    return Links(ctx, inbox, outbox, curve, auth)
