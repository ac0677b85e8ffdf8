"""KV transfer over NIXL with its UCX backend (optional extra: ``pip install splitserve[nixl]``).

Both workers start a NIXL agent (UCX backend, no NIXL progress thread: that one spins a whole
core) and register their KV pool's memory once. The decode worker's bootstrap ``endpoint``
carries its agent's name and metadata (a few hundred bytes, base64) and the pool's base address;
the prefill worker adds that agent once and writes each run of pages one-sidedly (NIXL
``WRITE``, a UCX ``put``) at ``base + page_id * page_bytes``, then sends the ``KVPages`` header
over ZeroMQ (``kv_transfer.one_sided``: writes on a background thread, headers in order, failed
requests fenced until this worker acknowledges that its writes ended).

UCX picks the transport: on one host the put is a single ``process_vm_writev`` copy (UCX's
``cma``), between hosts TCP, RDMA (verbs) where present. ``UCX_TLS`` / ``UCX_NET_DEVICES`` in both
workers' environment restrict it (``UCX_TLS=tcp UCX_NET_DEVICES=lo`` forces loopback TCP). On a
machine without RDMA devices the backend sets ``UCX_MODULES=^ib`` unless it is set (see
:func:`_start_agent`).

Progress: a UCX target must progress its worker for TCP data (and for every transport's
connection set-up), so the receiver runs a thread that polls NIXL's notifications: every
``IDLE_POLL_S`` when idle, every ``BUSY_POLL_S`` while a write is in flight (the sender sends a
``+`` notification before each write and the write carries a ``-`` one; no news for
``BUSY_TIMEOUT_S`` ends the busy state, e.g. when the sender died). The sender's writer thread
polls its own write (``BUSY_POLL_S``).
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import threading
import time
from pathlib import Path

import numpy as np

from splitserve.config import env
from splitserve.engine.kv_pool import KVPool
from splitserve.ipc.frames import Frames, as_frames
from splitserve.ipc.messages import KVBootstrap, KVPages
from splitserve.ipc.sockets import Outbox
from splitserve.kv_transfer.base import BaseKVReceiver, KVTransferBackend
from splitserve.kv_transfer.one_sided import BaseOneSidedSender

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.005  # receiver progress interval with no write in flight (~1.5% of a core)
BUSY_POLL_S = 20e-6  # progress interval while a write is in flight (both sides)
BUSY_TIMEOUT_S = 5.0  # receiver: busy without any notification this long -> idle
WRITE_TIMEOUT_S = 60.0  # sender: a write still in progress after this fails
BEGIN, END = b"+", b"-"  # notifications around each write


def _start_agent(role: str, pool: KVPool):
    """A NIXL agent with the UCX backend and ``pool``'s buffer registered.

    Returns:
        ``(agent, registration)``; ``registration`` is what ``deregister_memory`` takes.

    Raises:
        ValueError: NIXL is not installed, its UCX backend is missing or fails to start, or the
            pool is not in host memory.
    """
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise ValueError(
            f"KV transfer backend 'nixl' needs NIXL: pip install 'splitserve[nixl]' ({exc})"
        ) from exc
    buf = pool.buffer
    if buf.device.type != "cpu":
        raise ValueError(f"the nixl KV transfer backend registers host memory, not {buf.device}")
    if not any(Path("/sys/class/infiniband").glob("*")):
        # No RDMA device: keep UCX from loading its ib modules. NIXL 1.5.1's wheel bundles a
        # libnl-route that they link, and its destructor segfaulted every process that had
        # started a UCX agent, at exit (measured here; exit status 139).
        env.set_default(env.UCX_MODULES, "^ib")
    name = f"splitserve-{role}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    except Exception as exc:  # NIXL's own error types (e.g. a UCX_TLS naming no transport)
        raise ValueError(f"NIXL agent with the UCX backend failed to start: {exc}") from exc
    if "UCX" not in agent.backends:
        raise ValueError(f"NIXL has no UCX backend here (plugins: {agent.get_plugin_list()})")
    reg = agent.register_memory([(buf.data_ptr(), buf.numel() * buf.element_size(), 0, "")], "DRAM")
    return agent, reg


def _descs(addrs: list[int], lens: list[int]) -> np.ndarray:
    """NIXL transfer descriptors, shape ``(n, 3)``: address, length in bytes, device id 0."""
    out = np.zeros((len(addrs), 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = lens
    return out


class NixlKVSender(BaseOneSidedSender):
    """One-sided NIXL writes into the decode pool, on a background thread.

    Raises (constructor):
        ValueError: as :func:`_start_agent`.
    """

    name = "nixl"

    def __init__(self, pool: KVPool, outbox: Outbox) -> None:
        self.agent, self._reg = _start_agent("prefill", pool)
        self._peers: set[str] = set()  # remote agents added (touched by the writer thread only)
        super().__init__(pool, outbox)

    def _peer(self, boot: KVBootstrap) -> tuple[str, bytes]:
        return boot.endpoint["nixl_agent"], base64.b64decode(boot.endpoint["nixl_meta"], validate=True)

    def _write(self, peer: object, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        name, meta = peer
        try:
            state = self._write_to(name, meta, srcs, dsts, lens)
        except Exception as exc:  # NIXL raises its own error types
            raise RuntimeError(f"to agent {name}: {exc}") from exc
        if state != "DONE":
            late = " after the write timeout" if state == "PROC" else ""
            raise RuntimeError(f"to agent {name}: state {state}{late}")

    def _write_to(self, name: str, meta: bytes, srcs: list[int], dsts: list[int],
                  lens: list[int]) -> str:
        if name not in self._peers:
            added = self.agent.add_remote_agent(meta)
            if (added.decode() if isinstance(added, bytes) else added) != name:
                raise ValueError(f"its metadata names {added!r}")
            self._peers.add(name)
        local = self.agent.get_xfer_descs(_descs(srcs, lens), "DRAM")
        remote = self.agent.get_xfer_descs(_descs(dsts, lens), "DRAM")
        self.agent.send_notif(name, BEGIN)
        handle = self.agent.initialize_xfer("WRITE", local, remote, name, END)
        state = self.agent.transfer(handle)
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(BUSY_POLL_S)
            state = self.agent.check_xfer_state(handle)
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:  # noqa: BLE001 - a timed-out write may refuse to be released
            logger.warning("releasing a NIXL write to %s: %s", name, exc)
        return state

    def close(self) -> None:
        super().close()
        if not self._thread.is_alive():
            self.agent.deregister_memory(self._reg)


class NixlKVReceiver(BaseKVReceiver):
    """Registers the pool and progresses the NIXL agent on a thread; pages are written by the
    peer before the header arrives.

    Raises (constructor):
        ValueError: as :func:`_start_agent`.
    """

    name = "nixl"
    one_sided = True

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        self.agent, self._reg = _start_agent("decode", pool)
        self._meta = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._thread.start()

    def _progress(self) -> None:
        # The only thread that touches the agent after the constructor (NIXL's default thread
        # mode has no locks).
        busy, last_news = 0, time.monotonic()
        while not self._stop.is_set():
            notifs = self.agent.get_new_notifs()
            now = time.monotonic()
            for msgs in notifs.values():
                for msg in msgs:
                    busy = max(0, busy + (msg == BEGIN) - (msg == END))
                    last_news = now
            if busy and now - last_news > BUSY_TIMEOUT_S:
                busy = 0
            self._stop.wait(BUSY_POLL_S if busy else IDLE_POLL_S)

    def endpoint(self) -> dict[str, str]:
        return {
            "nixl_agent": self.agent.name,
            "nixl_meta": self._meta,
            "base_ptr": str(self.pool.buffer.data_ptr()),
            "num_pages": str(self.pool.allocator.num_pages),
        }

    def install(self, header: KVPages, frames: Frames | list) -> None:
        if header.num_frames or as_frames(frames).more:
            raise ValueError(f"KV message for {header.rid}: nixl transfer carries no frames")
        latency = time.time() - header.sent_at if header.sent_at else None
        num_bytes = len(header.page_ids) * self.pool.layout.page_bytes
        self.metrics.record_install(num_bytes, len(header.page_ids), latency)

    def close(self) -> None:
        """Stop the progress thread, then deregister the pool."""
        self._stop.set()
        self._thread.join(5)
        if not self._thread.is_alive():
            self.agent.deregister_memory(self._reg)


BACKEND = KVTransferBackend("nixl", NixlKVSender, NixlKVReceiver)
