"""A worker's link to its router outside the main loop: joining (``POST /workers/register``) and
a heartbeat thread.

The heartbeat runs on its own thread and socket so that a long forward pass (torch releases the
GIL while it computes) does not make a healthy worker look dead; a dead process or host stops
it, and the router notices within its ``dead_after_s``.

A worker may report to several routers (API servers behind one load balancer, each sending
its own tasks): the heartbeat goes to each one's inbox. A worker that joined its routers by URL
also re-registers with each from that thread every ``REJOIN_S`` (registration is idempotent by
address): when a router has restarted, it answers that it did not know the worker (and, without
a fixed ``--inbox``, gives a new inbox), so the worker points that router's heartbeats at the
new inbox and announces itself ready there again. Requests in flight on the old router are lost
with it: the worker ends them and frees their pages (``worker.routers``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import zmq

from splitserve.ipc.messages import Message, WorkerStats, encode

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
REJOIN_S = 2.0  # how often a worker that joined by URL checks that its router still knows it


class Heartbeat(threading.Thread):
    """Sends ``stats()`` to each of ``server_addrs`` every ``interval_s`` until :meth:`stop`.

    Args:
        server_addrs: the inboxes of the routers the worker reports to.
        rejoin: for a worker that joined by URL: ``rejoin(i)`` is called for each router every
            ``REJOIN_S`` seconds; it returns ``(inbox, ready)`` when router ``i`` did not know
            the worker (it restarted): the heartbeat then beats to that inbox and sends it the
            ``ready`` announcement. None when the router knows the worker or did not answer.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        server_addrs: list[str],
        stats: Callable[[], WorkerStats],
        interval_s: float = HEARTBEAT_S,
        configure: Callable[[zmq.Socket], None] | None = None,
        rejoin: Callable[[int], tuple[str, Message] | None] | None = None,
    ) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.ctx, self.stats, self.interval_s = ctx, stats, interval_s
        self.server_addrs = list(server_addrs)
        self.configure = configure
        self.rejoin = rejoin
        self.stopping = threading.Event()

    def _connect(self, addr: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # a router that is away gets only the latest beats
        if self.configure is not None:
            self.configure(sock)
        sock.connect(addr)
        return sock

    def _ask_routers(self) -> list[tuple[int, tuple[str, Message] | None]]:
        """Off the heartbeat thread: one rejoin per router (HTTP; up to its timeout each when a
        router is unreachable, which must not delay the beats to the others)."""
        return [(i, self.rejoin(i)) for i in range(len(self.server_addrs))]

    def run(self) -> None:
        socks = [self._connect(addr) for addr in self.server_addrs]
        asker = ThreadPoolExecutor(1, thread_name_prefix="rejoin") if self.rejoin else None
        asking: Future | None = None
        next_rejoin = time.monotonic() + REJOIN_S
        try:
            while not self.stopping.wait(self.interval_s):
                if asker is not None and asking is None and time.monotonic() >= next_rejoin:
                    asking = asker.submit(self._ask_routers)
                elif asking is not None and asking.done():
                    try:
                        answers = asking.result()
                    except Exception:  # a bug in a rejoin must not stop the heartbeat
                        logger.exception("rejoining the routers failed")
                        answers = []
                    for i, answer in answers:
                        if answer is not None:  # router i restarted: beat to its new inbox
                            self.server_addrs[i], ready = answer
                            socks[i].close(0)
                            socks[i] = self._connect(self.server_addrs[i])
                            socks[i].send(encode(ready))  # queued until the connection is up
                    asking, next_rejoin = None, time.monotonic() + REJOIN_S
                try:
                    beat = encode(self.stats())
                except RuntimeError:  # the main thread changed a queue while we read it
                    continue
                for sock in socks:
                    try:
                        sock.send(beat, zmq.NOBLOCK)
                    except zmq.Again:
                        pass
        finally:
            for sock in socks:
                sock.close(0)
            if asker is not None:
                asker.shutdown(wait=False, cancel_futures=True)

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
    return _register(router_url, role, worker_id, addr, api_key, timeout_s)["server_addr"]


def rejoin_router(
    router_url: str, role: str, worker_id: str, addr: str, api_key: str | None = None
) -> str | None:
    """Register again (one try, a 2 s timeout). Returns the router's inbox when the router did
    not already know this worker as ready at ``addr`` (it restarted, or forgot a dead worker),
    else None; None too when it does not answer or refuses (the next try may succeed)."""
    try:
        reply = _register(router_url, role, worker_id, addr, api_key, timeout_s=0, http_s=2.0)
    except RegistrationError as exc:
        logger.debug("rejoin %s: %s", router_url, exc)
        return None
    return None if reply.get("known") else reply["server_addr"]


def _register(
    router_url: str,
    role: str,
    worker_id: str,
    addr: str,
    api_key: str | None,
    timeout_s: float,
    http_s: float = 10.0,
) -> dict:
    """``POST /workers/register`` until it answers or ``timeout_s`` passes; the reply's JSON."""
    body = json.dumps({"role": role, "worker_id": worker_id, "addr": addr}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    url = router_url.rstrip("/") + "/workers/register"
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=http_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500:
                raise RegistrationError(f"router refused registration: {exc.code} "
                                        f"{exc.read().decode(errors='replace')}") from exc
            error = str(exc)
        except OSError as exc:
            error = str(exc)
        if time.monotonic() >= deadline:
            raise RegistrationError(f"router {router_url} did not answer: {error}")
        time.sleep(1.0)
