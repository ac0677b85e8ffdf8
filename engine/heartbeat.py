"""A worker's link to its router outside the main loop: joining (``POST /workers/register``) and
a heartbeat thread.

The heartbeat runs on its own thread and socket so that a long forward pass (torch releases the
GIL while it computes) does not make a healthy worker look dead; a dead process or host stops
it, and the router notices within its ``dead_after_s``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import zmq

from splitserve.messages import WorkerStats, encode

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5


class Heartbeat(threading.Thread):
    """Sends ``stats()`` to ``server_addr`` every ``interval_s`` until :meth:`stop`."""

    def __init__(
        self,
        ctx: zmq.Context,
        server_addr: str,
        stats: Callable[[], WorkerStats],
        interval_s: float = HEARTBEAT_S,
        configure: Callable[[zmq.Socket], None] | None = None,
    ) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.ctx, self.server_addr, self.stats, self.interval_s = ctx, server_addr, stats, interval_s
        self.configure = configure
        self.stopping = threading.Event()

    def run(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # a router that is away gets only the latest beats
        if self.configure is not None:
            self.configure(sock)
        sock.connect(self.server_addr)
        try:
            while not self.stopping.wait(self.interval_s):
                try:
                    sock.send(encode(self.stats()), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                except RuntimeError:  # the main thread changed a queue while we read it
                    pass
        finally:
            sock.close(0)

    def stop(self) -> None:
        self.stopping.set()


class RegistrationError(RuntimeError):
    """The router refused the worker (bad API key, bad role) or never answered."""


def register_with_router(
    router_url: str,
    role: str,
    worker_id: str,
    addr: str,
    api_key: str | None = None,
    timeout_s: float = 120.0,
) -> str:
    """Announce this worker to the router at ``router_url``; return the router's ZeroMQ inbox
    (where replies and heartbeats go). Retries until the router answers or ``timeout_s`` passes.

    Raises:
        RegistrationError: refused (4xx), or no answer within ``timeout_s``.
    """
    body = json.dumps({"role": role, "worker_id": worker_id, "addr": addr}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    url = router_url.rstrip("/") + "/workers/register"
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read())["server_addr"]
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500:
                raise RegistrationError(f"router refused registration: {exc.code} "
                                        f"{exc.read().decode(errors='replace')}") from exc
            error = str(exc)
        except OSError as exc:
            error = str(exc)
        if time.monotonic() > deadline:
            raise RegistrationError(f"router {router_url} did not answer: {error}")
        time.sleep(1.0)
