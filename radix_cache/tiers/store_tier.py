"""The shared tier: KV blocks in a Mooncake Store (``--kv-store mooncake://HOST:PORT``).

Mooncake Store (the ``mooncake`` extra's wheel ships its ``mooncake_master`` and the
``mooncake.store`` client) is a distributed object store for KV cache: one master keeps the
metadata, and every client mounts a segment of its own memory (``--kv-store-segment-mb``) that
the master allocates objects in; a get reads the object from whichever client's segment holds
it, over the Transfer Engine (TCP here, RDMA where there is RDMA). SGLang's HiCache uses it as its
L3 the same way. Here every prefill (or colocated) worker is a client: a block one worker
computed is read by another instead of recomputed, and the keys are the content addresses of
``block_hash``, so workers of another model or tenant never read it.

Objects live in the clients' segments: a worker that exits takes its segment's blocks with it
(the master forgets them), and the master evicts when the segments are full. Each object is a
``block_codec`` block (header, checksum, payload), checked when read.

A store that went away (master unreachable: a get or put fails, ``health_check`` says so) is
skipped for ``RETRY_S`` seconds, then asked again: meanwhile every request recomputes what it
would have loaded, and the failures are counted. Thread-safe as the Mooncake client is: the
load thread reads while the write thread writes.
"""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import urlparse

import torch

from splitserve.radix_cache.tiers.block_codec import (
    HEADER_BYTES,
    BlockCorrupt,
    decode_block,
    encode_block,
)
from splitserve.radix_cache.tiers.disk_tier import TierWriteError

logger = logging.getLogger(__name__)

RETRY_S = 5.0  # how long a store that failed is left alone before it is asked again
READ_BATCH = 16  # blocks per batched read
MIN_SEGMENT_BYTES = 16 * 2**20  # Mooncake refuses smaller segments
KEY_PREFIX = "sskv/"


class StoreUnavailable(OSError):
    """The store did not answer (its master is gone, or it was never reached)."""


def parse_store_url(url: str) -> str:
    """``mooncake://HOST:PORT`` -> ``HOST:PORT`` (the master's RPC address).

    Raises:
        ValueError: another scheme, or no host and port.
    """
    parsed = urlparse(url)
    if parsed.scheme != "mooncake" or not parsed.hostname or not parsed.port:
        raise ValueError(f"kv_store: {url!r} is not mooncake://HOST:PORT")
    return f"{parsed.hostname}:{parsed.port}"


class MooncakeStoreTier:
    """KV blocks in a Mooncake Store, shared by every worker that names the same master.

    Args:
        url: ``mooncake://HOST:PORT`` of the ``mooncake_master``.
        local_host: this worker's address as the other clients reach it (its segment is read
            from there).
        segment_bytes: memory this worker lends the store (at least 16 MiB).
        sizes: payload bytes per format this pool reads back (``BlockFormat.sizes``).

    Raises:
        ImportError: the ``mooncake`` extra is not installed.
        StoreUnavailable: the master could not be reached at start.
    """

    name = "store"

    def __init__(self, url: str, local_host: str, segment_bytes: int,
                 sizes: dict[str, int]) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError("--kv-store mooncake:// needs Mooncake Store: pip install "
                              f"'splitserve[mooncake]' ({exc})") from exc
        self.url = url
        self.sizes = sizes
        self.block_bytes = HEADER_BYTES + max(sizes.values())
        self.segment_bytes = max(segment_bytes, MIN_SEGMENT_BYTES)
        self.client = MooncakeDistributedStore()
        local_buffer = max(MIN_SEGMENT_BYTES, 4 * self.block_bytes)
        rc = self.client.setup(local_host, "P2PHANDSHAKE", self.segment_bytes, local_buffer,
                               "tcp", "", parse_store_url(url))
        if rc != 0:
            raise StoreUnavailable(f"Mooncake Store at {url}: setup failed (code {rc})")
        # Reads land in one registered buffer, a batch at a time (the load thread's own).
        self._read_buf = torch.empty(READ_BATCH * self.block_bytes, dtype=torch.uint8)
        self.client.register_buffer(self._read_buf.data_ptr(), self._read_buf.numel())
        self._down_until = 0.0
        self._lock = threading.Lock()

    # ---- health -------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while a recent failure is being waited out (then the master is asked)."""
        with self._lock:
            if self._down_until == 0.0:
                return True
            if time.monotonic() < self._down_until:
                return False
        if self.client.health_check() == 0:
            with self._lock:
                self._down_until = 0.0
            logger.warning("KV store %s answers again", self.url)
            return True
        self._mark_down("still unreachable")
        return False

    def _mark_down(self, why: str) -> None:
        with self._lock:
            first = self._down_until == 0.0
            self._down_until = time.monotonic() + RETRY_S
        if first:
            logger.error("KV store %s: %s; requests recompute until it answers", self.url, why)

    # ---- I/O (the I/O threads) -----------------------------------------------------------------

    def read_run(self, keys: list[str]) -> list[tuple[str, torch.Tensor]]:
        """``(fmt, payload)`` of the leading ``keys`` the store holds, in order, stopping at the
        first it does not (at most :data:`READ_BATCH`).

        Raises:
            StoreUnavailable: the store did not answer (then it is skipped for a while).
            BlockCorrupt: a block failed its checks (it is removed from the store).
        """
        keys = keys[:READ_BATCH]
        if not keys or not self.available:
            raise StoreUnavailable(f"KV store {self.url} is unavailable")
        base, size = self._read_buf.data_ptr(), self.block_bytes
        codes = self.client.batch_get_into([KEY_PREFIX + k for k in keys],
                                           [base + i * size for i in range(len(keys))],
                                           [size] * len(keys))
        out: list[tuple[str, torch.Tensor]] = []
        for i, (key, code) in enumerate(zip(keys, codes)):
            if code < 0:
                if code != -704 and not out:  # -704: no such object; others: the store failed
                    self._mark_down(f"read failed (code {code})")
                    raise StoreUnavailable(f"KV store {self.url}: read failed (code {code})")
                break
            view = memoryview(self._read_buf.numpy())[i * size : i * size + code]
            try:
                fmt, payload = decode_block(key, view, self.sizes)
            except BlockCorrupt:
                self.client.remove(KEY_PREFIX + key)
                raise
            out.append((fmt, torch.frombuffer(bytearray(payload), dtype=torch.uint8)))
        return out

    def write(self, key: str, fmt: str, payload: memoryview | bytes) -> None:
        """Put block ``key`` (a key already there is left as it is).

        Raises:
            TierWriteError: the store is full (it evicts in the background) or did not answer.
        """
        if not self.available:
            raise TierWriteError(0, f"KV store {self.url} is unavailable")
        code = self.client.put(KEY_PREFIX + key, encode_block(key, fmt, payload))
        if code == 0:
            return
        if code != -200:  # -200: no room now (the master evicts); others: the store failed
            self._mark_down(f"write failed (code {code})")
        raise TierWriteError(0, f"KV store {self.url}: put of block {key} failed (code {code})")

    def remove(self, key: str) -> None:
        """Remove block ``key`` (best effort)."""
        self.client.remove(KEY_PREFIX + key)

    def close(self) -> None:
        self.client.close()
